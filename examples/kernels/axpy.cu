// axpy: y[i] = a * x[i] + y[i] for i < count (f32). Any grid and block shape (grid-stride loop).
// Its host twin is `axpy` in examples/user_kernel.py, registered with @tray.twin("axpy").

extern "C" __global__ void example_axpy(float* y, const float* x, unsigned long long count, float a) {
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += stride) {
        y[i] = a * x[i] + y[i];
    }
}
