"""Real vLLM GPU engines on the device machine (``python3 -m scripts.gpu_pd``)."""
