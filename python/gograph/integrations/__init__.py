"""Switches that make a training framework's own CUDA-graph path capture with gograph.

* :mod:`gograph.integrations.megatron` -- Megatron-Core's ``cuda_graph_impl="transformer_engine"``
  path (``TECudaGraphHelper``).

Each is imported on demand: importing :mod:`gograph` imports no framework.
"""
