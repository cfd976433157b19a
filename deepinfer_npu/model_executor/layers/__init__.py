"""Model building blocks, each a thin module over ``backend.kernels`` ops."""
