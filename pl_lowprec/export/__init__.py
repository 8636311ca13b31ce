"""What a fine-tune ends as: a peft adapter directory or a merged Hugging Face model (``pl-lowprec export``).

- ``restore``: the trained module, rebuilt from its config and a checkpoint through the strategy's transform.
- ``merge_into_pretrained``: the LoRA deltas added to the original pretrained safetensors.
- ``gguf_export.export_gguf``: that merged model as one GGUF file for llama.cpp, with an Ollama Modelfile.
"""

from pl_lowprec.export.merged import merge_into_pretrained
from pl_lowprec.export.restore import Restored, restore

__all__ = ["Restored", "merge_into_pretrained", "restore"]
