"""Your own kernel: CUDA C for the GPU, a numpy twin for the host backend, registered from your code.

Run: tray launch -n 2 --backend host --manifest examples/user_kernel.json examples/user_kernel.py

The manifest names the kernel `axpy` (source kernels/axpy.cu, entry example_axpy). On cuda, NVRTC compiles
the source for the GPU; on the host backend the rank calls the function registered under the same name
with `@tray.twin("axpy")`. A twin gets (backend, grid, block, *args) with the kernel's arguments as the
manifest passes them (buffer addresses as ints, vars as ints, literals as int or float) and must write
exactly the bytes the kernel writes. Register twins before `tray.init()`: import the module that holds
them, or define them at the top of the program, as here.
"""

import numpy as np

import tray
from tray.twins import f32_at


@tray.twin("axpy")
def axpy(backend, grid, block, y_ptr: int, x_ptr: int, count: int, a: float) -> None:
    """y[i] = a * x[i] + y[i] for i < count, in float32 like the kernel."""
    y = f32_at(y_ptr, count)
    y[:] = np.float32(a) * f32_at(x_ptr, count) + y


with tray.init() as rank:
    count = rank.buffer("x").shape[0]
    x = np.linspace(-1, 1, count, dtype=np.float32) * (rank.rank + 1)
    rank.write("x", x)
    rank.write("y", np.ones(count, np.float32))
    rank.run("twice")  # two launches of axpy and a barrier, as the manifest lists them
    rank.synchronize()
    want = np.float32(0.25) * x + (np.float32(0.5) * x + np.float32(1))
    assert np.array_equal(rank.read("y"), want)
    print(f"rank {rank.rank}: axpy ran twice through its host twin over {count} elements")
