"""deepinfer_npu: DeepSeek-family inference on Ascend NPUs and NVIDIA GPUs with a CPU reference backend."""

__version__ = "0.1.0"
