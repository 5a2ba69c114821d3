"""Running generated kernels: the module loader and cache, tuning, the autograd functions, the
float64 reference scan, tensors' validation, the offline solve and context parallelism."""
