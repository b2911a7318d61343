"""The built-in manifests and their CUDA kernels, as package data.

Installed as `tray._builtin` (`tray/_builtin` links to this folder, so a source checkout, an editable
install and a wheel read it the same way); read through `tray.manifest.builtin`, never by path.
"""
