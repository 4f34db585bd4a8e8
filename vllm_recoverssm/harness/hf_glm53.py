"""A tiny GLM-5.3-Flash made and run by transformers: the model-level oracle.

:func:`make_checkpoint` builds ``Glm5NextForConditionalGeneration`` with transformers' own
classes from a fixed seed, makes every weight matter (norm weights, ``A_log``, the mHC
scales and biases are drawn instead of left at their constant initial values) and saves
it as a Hugging Face checkpoint: float32 safetensors, a word-level tokenizer, and a
``config.json`` completed with the text-config fields vLLM's GLM-5.3 reads and
transformers does not keep (:data:`VLLM_TEXT_FIELDS`). vLLM loads the directory with its
default loader.

:func:`greedy` runs transformers' ``generate`` on it (greedy, no speculation, float32)
and keeps each step's log-probabilities. transformers' GLM-5.3-Flash calls fla's GPU
kernels when ``fla`` imports; the CPU path here hides fla and causal-conv1d so that its
PyTorch KDA and conv fallbacks run (:func:`hide_gpu_kernels`). Run it in a process of its
own (``python -m vllm_recoverssm.harness.hf_glm53 greedy ...``), since hiding a package
lasts for the process.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ARCHITECTURE = "Glm5NextForConditionalGeneration"
VLLM_TEXT_FIELDS: dict[str, Any] = {
    "mhc": True,
    "mla_use_nope": True,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "indexer_rope_interleave": False,
}
"""Text-config fields vLLM's GLM-5.3 reads without a default; ``Glm5NextTextConfig``
drops them. GLM-5.3-Flash keeps mHC residual streams (transformers' model always mixes
``hc_mult`` streams), NoPE MLA, sigmoid ``noaux_tc`` routing."""
SPECIAL_TOKENS = ("<pad>", "<unk>")
_GPU_KERNEL_PACKAGES = ("fla", "causal_conv1d")


@dataclass(frozen=True)
class TinyFlash:
    """The shape of the tiny GLM-5.3-Flash: every text layer KDA, dense MLPs, no MTP.

    KDA keeps GLM-5.3's real head dim (128), conv width (4) and gate bound (-5); the
    default ``linear_heads=2`` is one head per rank at tensor parallel 2.
    """

    num_layers: int = 2
    linear_heads: int = 2
    head_dim: int = 128
    hidden_size: int = 256
    intermediate_size: int = 512
    vocab_size: int = 512
    hc_mult: int = 4
    conv_width: int = 4
    lower_bound: float = -5.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_layers", "linear_heads", "head_dim", "hidden_size",
                     "intermediate_size", "vocab_size", "hc_mult", "conv_width"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 4096:
                raise ValueError(f"{name}: expected an integer in 1..4096, got {value!r}")
        if self.vocab_size < 64:
            raise ValueError(f"vocab_size: expected at least 64, got {self.vocab_size}")

    @property
    def image_token_ids(self) -> dict[str, int]:
        """The multimodal marker tokens, at the top of the vocabulary."""
        top = self.vocab_size
        return {"image_token_id": top - 6, "video_token_id": top - 5,
                "image_start_token_id": top - 4, "image_end_token_id": top - 3,
                "video_start_token_id": top - 2, "video_end_token_id": top - 1}


def hide_gpu_kernels() -> None:
    """Make ``import fla`` and ``import causal_conv1d`` fail in this process, so that
    transformers' GLM-5.3-Flash takes its PyTorch KDA and conv paths on a CPU."""
    for name in _GPU_KERNEL_PACKAGES:
        sys.modules[name] = None  # type: ignore[assignment]


def text_config(shape: TinyFlash) -> dict[str, Any]:
    """``Glm5NextTextConfig`` arguments for ``shape``; MLA and MoE fields are never used
    (no attention layer, no sparse MLP) but must be consistent."""
    layers = shape.num_layers
    return dict(
        vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=64, q_lora_rank=64,
        qk_nope_head_dim=64, v_head_dim=64, index_topk=64, index_head_dim=64,
        index_n_heads=2, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
        layer_types=["linear_attention"] * layers, mlp_layer_types=["dense"] * layers,
        indexer_types=["full"] * layers, linear_head_dim=shape.head_dim,
        linear_num_heads=shape.linear_heads, linear_conv_kernel_dim=shape.conv_width,
        linear_lower_bound=shape.lower_bound, hc_mult=shape.hc_mult, initializer_range=0.05,
        pad_token_id=0, bos_token_id=None, eos_token_id=None, max_position_embeddings=4096,
    )


def vision_config(shape: TinyFlash) -> dict[str, Any]:
    """A one-block vision tower whose merger feeds the text model's width."""
    return dict(depth=1, hidden_size=64, num_heads=2, intermediate_size=128,
                out_hidden_size=shape.hidden_size, projection_intermediate_size=128,
                patch_size=14, spatial_merge_size=2, temporal_patch_size=2)


def _draw_constant_weights(model: Any, seed: int) -> None:
    """Draw the weights transformers initialises to constants (ones, zeros), so that a
    wrong use of any of them changes the outputs."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)

    def normal(p: Any, mean: float, std: float) -> None:
        p.copy_(mean + std * torch.randn(p.shape, generator=gen))

    def uniform(p: Any, low: float, high: float) -> None:
        p.copy_(low + (high - low) * torch.rand(p.shape, generator=gen))

    with torch.no_grad():
        for name, p in model.model.language_model.named_parameters():
            if name.endswith("norm.weight"):
                normal(p, 1.0, 0.2)
            elif name.endswith("forget_gate.A_log"):
                uniform(p, -0.5, 1.0)
            elif name.endswith("hc.base"):
                normal(p, 0.0, 0.5)
            elif name.endswith("hc.scale"):
                uniform(p, 0.5, 1.5)
            elif name.endswith("conv1d.weight"):
                normal(p, 0.0, 0.3)
            elif name.endswith("b_proj.weight") and ".g_b_proj" not in name \
                    and ".f_b_proj" not in name:
                normal(p, 0.0, 0.2)


def _word(i: int) -> str:
    return f"w{i}"


MARKER_TOKENS = {
    "image_token_id": "<|image|>", "video_token_id": "<|video|>",
    "image_start_token_id": "<|begin_of_image|>", "image_end_token_id": "<|end_of_image|>",
    "video_start_token_id": "<|begin_of_video|>", "video_end_token_id": "<|end_of_video|>",
}
"""GLM-5.3-Flash's multimodal marker tokens, by the config field holding each one's id."""


def save_processor(directory: Path, shape: TinyFlash) -> None:
    """transformers' own GLM-5.3-Flash processor: a word-level tokenizer (``<pad>``,
    ``<unk>``, then ``w2 .. wN``, whitespace split, the multimodal markers as special
    tokens at the top of the vocabulary) and image and video processors sized for the
    tiny vision tower (at most 16 image tokens)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import Glm5NextProcessor, PreTrainedTokenizerFast
    from transformers.models.glm5_next.image_processing_glm5_next import (
        Glm5NextImageProcessor,
    )
    from transformers.models.glm5_next.video_processing_glm5_next import (
        Glm5NextVideoProcessor,
    )

    markers = {shape.image_token_ids[field]: text for field, text in MARKER_TOKENS.items()}
    vocab = {}
    for i in range(shape.vocab_size):
        vocab[SPECIAL_TOKENS[i] if i < len(SPECIAL_TOKENS) else markers.get(i, _word(i))] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>",
        additional_special_tokens=[markers[i] for i in sorted(markers)])
    images = Glm5NextImageProcessor(min_image_tokens=4, max_image_tokens=16)
    processor = Glm5NextProcessor(image_processor=images, tokenizer=tokenizer,
                                  video_processor=Glm5NextVideoProcessor())
    processor.save_pretrained(str(directory))


def words(token_ids: Sequence[int]) -> str:
    """The text whose tokenization is ``token_ids`` (ids of plain words only)."""
    return " ".join(_word(int(t)) for t in token_ids)


def make_checkpoint(directory: Path, shape: TinyFlash | None = None) -> Path:
    """Build the tiny GLM-5.3-Flash with transformers and save it into ``directory``."""
    hide_gpu_kernels()
    import torch
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    shape = shape or TinyFlash()
    fields: dict[str, Any] = dict(shape.image_token_ids)
    config = Glm5NextConfig(text_config=text_config(shape), vision_config=vision_config(shape),
                            **fields)
    torch.manual_seed(shape.seed)
    model = Glm5NextForConditionalGeneration(config).float().eval()
    _draw_constant_weights(model, shape.seed)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(directory), safe_serialization=True)
    save_processor(directory, shape)
    path = directory / "config.json"
    saved = json.loads(path.read_text())
    saved["text_config"].update(VLLM_TEXT_FIELDS)
    saved["recoverssm_tiny_flash"] = asdict(shape)
    path.write_text(json.dumps(saved, indent=1))
    return directory


def _greedy_with_image(model: Any, processor: Any, prompt: dict[str, str],
                       max_new_tokens: int) -> tuple[Any, list[Any]]:
    """Greedy steps of an image prompt: its prompt ids and each step's logits.

    ``generate`` re-scans the whole sequence for image tokens at every step when it
    cannot cache, and stops once the model emits one of them; vLLM embeds generated
    tokens as text. So the image features are merged into the prompt's embeddings once
    and each greedy token's embedding is appended (the text model has no positions: NoPE,
    no attention layer), as vLLM computes it.
    """
    import torch
    from PIL import Image

    with Image.open(prompt["image"]) as image:
        inputs = processor(text=[prompt["text"]], images=[image.convert("RGB")],
                           return_tensors="pt")
    ids = inputs["input_ids"]
    embed = model.get_input_embeddings()
    features = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"],
                                              return_dict=True)
    image_embeds = torch.cat(list(features.pooler_output), dim=0)
    embeds = embed(ids)
    mask = (ids == model.config.image_token_id).unsqueeze(-1).expand_as(embeds)
    embeds = embeds.masked_scatter(mask, image_embeds.to(embeds.dtype))
    step_logits = []
    for _ in range(max_new_tokens):
        logits = model(inputs_embeds=embeds, use_cache=False).logits[0, -1]
        step_logits.append(logits)
        token = logits.argmax().view(1, 1)
        embeds = torch.cat([embeds, embed(token)], dim=1)
    return ids, step_logits


HFPrompt = Sequence[int] | dict[str, str]
"""Token ids, or ``{"text": ..., "image": FILE}`` (through the checkpoint's processor)."""


def greedy(directory: Path, prompts: Sequence[HFPrompt], max_new_tokens: int,
           top_logprobs: int = 5) -> dict[str, Any]:
    """transformers' greedy ``generate`` (no speculation, float32) on each prompt.

    Returns ``{"prompt_ids": [[token]...], "outputs": [[token]...], "logprobs":
    [[{token: logprob}...]...], "first_logits": [[float]...]}``: each prompt's token ids
    (an image prompt's with its image tokens), for every step the ``top_logprobs`` best tokens'
    log-probabilities, and each prompt's full first-step logits. The model has no
    attention layer, so transformers' cache cannot tell its length; ``use_cache=False``
    recomputes the whole sequence at every step instead, which is exact.
    """
    hide_gpu_kernels()
    import torch
    from transformers import AutoProcessor, Glm5NextForConditionalGeneration

    model = Glm5NextForConditionalGeneration.from_pretrained(
        str(directory), dtype=torch.float32).eval()
    processor = None
    prompt_ids, outputs, logprobs, first = [], [], [], []
    with torch.no_grad():
        for prompt in prompts:
            if isinstance(prompt, dict):
                processor = processor or AutoProcessor.from_pretrained(str(directory))
                ids, step_logits = _greedy_with_image(model, processor, prompt,
                                                      max_new_tokens)
            else:
                ids = torch.tensor([list(prompt)], dtype=torch.long)
                out = model.generate(ids, attention_mask=torch.ones_like(ids),
                                     do_sample=False, max_new_tokens=max_new_tokens,
                                     min_new_tokens=max_new_tokens, use_cache=False,
                                     output_logits=True, return_dict_in_generate=True,
                                     pad_token_id=0)
                step_logits = [logits[0] for logits in out.logits]
            prompt_ids.append(ids[0].tolist())
            outputs.append([int(logits.argmax()) for logits in step_logits])
            steps = []
            for logits in step_logits:
                lp = torch.log_softmax(logits.float(), dim=-1)
                top = torch.topk(lp, top_logprobs)
                steps.append({int(t): float(v) for t, v in zip(top.indices, top.values,
                                                                 strict=True)})
            logprobs.append(steps)
            first.append(step_logits[0].float().tolist())
    return {"prompt_ids": prompt_ids, "outputs": outputs, "logprobs": logprobs,
            "first_logits": first}


MODULE = "vllm_recoverssm.harness.hf_glm53"


def _run_module(args: Sequence[str], timeout: float) -> None:
    proc = subprocess.run([sys.executable, "-m", MODULE, *args], capture_output=True,
                          text=True, timeout=timeout)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
        raise RuntimeError(f"transformers run failed (exit {proc.returncode}):\n{tail}")


def make_in_subprocess(directory: Path, shape: TinyFlash | None = None,
                       timeout: float = 300) -> Path:
    """:func:`make_checkpoint` in a fresh process (fla stays importable in this one)."""
    shape = shape or TinyFlash()
    _run_module(["make", str(directory), "--layers", str(shape.num_layers),
                 "--heads", str(shape.linear_heads), "--seed", str(shape.seed)], timeout)
    return directory


def greedy_in_subprocess(directory: Path, prompts: Sequence[HFPrompt],
                         max_new_tokens: int, workdir: Path,
                         timeout: float = 600) -> dict[str, Any]:
    """:func:`greedy` in a fresh process; its result."""
    workdir.mkdir(parents=True, exist_ok=True)
    request, result = workdir / "hf-request.json", workdir / "hf-result.json"
    request.write_text(json.dumps({"prompts": [p if isinstance(p, dict) else list(map(int, p))
                                               for p in prompts],
                                   "max_new_tokens": int(max_new_tokens)}))
    _run_module(["greedy", str(directory), str(request), str(result)], timeout)
    out: dict[str, Any] = json.loads(result.read_text())
    out["logprobs"] = [[{int(t): v for t, v in step.items()} for step in steps]
                       for steps in out["logprobs"]]
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m vllm_recoverssm.harness.hf_glm53 make DIR`` or ``greedy DIR REQUEST
    RESULT`` (REQUEST: ``{"prompts": [...], "max_new_tokens": N}``, each prompt token ids
    or ``{"text": ..., "image": FILE}``)."""
    parser = argparse.ArgumentParser(prog="python -m vllm_recoverssm.harness.hf_glm53")
    sub = parser.add_subparsers(dest="action", required=True)
    make = sub.add_parser("make")
    make.add_argument("directory", type=Path)
    make.add_argument("--layers", type=int, default=TinyFlash.num_layers)
    make.add_argument("--heads", type=int, default=TinyFlash.linear_heads)
    make.add_argument("--seed", type=int, default=TinyFlash.seed)
    run = sub.add_parser("greedy")
    run.add_argument("directory", type=Path)
    run.add_argument("request", type=Path)
    run.add_argument("result", type=Path)
    args = parser.parse_args(argv)
    if args.action == "make":
        make_checkpoint(args.directory, TinyFlash(num_layers=args.layers, linear_heads=args.heads,
                                                   seed=args.seed))
        return 0
    request = json.loads(args.request.read_text())
    result = greedy(args.directory, request["prompts"], int(request["max_new_tokens"]))
    args.result.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
