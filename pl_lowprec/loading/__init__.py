"""Pretrained weights streamed into a model built on the meta device, quantized as they arrive.

- ``empty_weights``: build a module whose parameters are on the meta device (buffers stay real).
- ``resolve_checkpoint``: a safetensors file, a sharded directory with its index, or a Hugging Face model
  directory, as a map from key to file, shape and dtype (headers only; no tensor is read), opened through the
  ``sources.WeightFiles`` of the load that reads the tensors next (a .bin is unpickled once for both).
- ``load_pretrained``: materialize the module tensor by tensor; layers that will be quantized are quantized
  straight from the loaded tensor.
"""

from pl_lowprec.loading.empty import empty_weights, has_meta_tensors
from pl_lowprec.loading.sources import CheckpointIndex, PrefixMap, PretrainedWeights, prefix_map, resolve_checkpoint
from pl_lowprec.loading.stream import load_pretrained

__all__ = [
    "CheckpointIndex",
    "PrefixMap",
    "PretrainedWeights",
    "empty_weights",
    "has_meta_tensors",
    "load_pretrained",
    "prefix_map",
    "resolve_checkpoint",
]
