"""Small C kernels for CPU, built once with the system compiler and called through ctypes."""
