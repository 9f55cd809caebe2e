"""The embedder's weights as an ONNX graph, made once from the model folder itself.

The graph is the whole sentence embedding (the transformer, mean pooling over the
attention mask, L2 normalisation), so that serving needs only a tokenizer and an
onnxruntime session: no torch in the serving process, and about a third of the time
per query that sentence-transformers takes on one CPU thread.

It is exported by torch in a child process (``python -m router.onnx_export``), which
keeps torch out of the parent's memory, checked there against sentence-transformers
on a few probe sentences, and renamed into place only once it agrees. ``int8``
quantizes the weights of every matrix product per channel except each layer's FFN
output (the 1536->384 product after GELU, whose activations quantize worst; with it
quantized too the cosine to the float vectors fell to 0.98 on Quora questions).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import Final, Literal

Precision = Literal["fp32", "int8"]

# Exported graphs differ from sentence-transformers' own vectors by no more than this
# (1 - cosine) on the probes, or they are refused: fp32 is the same arithmetic, int8
# the quantized weights (0.977 on the probe "ok", 0.989 and up on Quora questions).
_AGREEMENT: Final[dict[Precision, float]] = {"fp32": 1e-4, "int8": 0.03}
_PROBES: Final = (
    "What is the capital of France?",
    "How do I reset my password if I no longer have access to my email?",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many "
    "clips in May. How many clips did Natalia sell altogether in April and May?",
    "Is it safe to eat raw cookie dough?",
    "¿Cuál es la montaña más alta del mundo?",
    "ok",
)
INPUTS: Final = ("input_ids", "attention_mask", "token_type_ids")


class ExportFailed(Exception):
    """The ONNX graph could not be made, or disagreed with the model it came from."""


def onnx_file(model_dir: Path, fingerprint: str, precision: Precision, models_dir: Path) -> Path:
    """The graph for ``model_dir``'s weights, exported on first use into ``models_dir``
    (a child process; about ten seconds). Its name carries the weights' fingerprint,
    so other weights never find it."""
    digest = fingerprint.rpartition(":")[2]
    target = models_dir / f"embedder-{digest}-{precision}.onnx"
    if target.is_file():
        return target
    models_dir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "router.onnx_export", str(model_dir), str(target)]
    done = subprocess.run(
        [*command, "--precision", precision], capture_output=True, text=True, check=False
    )
    if done.returncode != 0 or not target.is_file():
        tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
        raise ExportFailed(
            f"exporting the embedder {model_dir} to ONNX failed (exit {done.returncode}): "
            + " / ".join(tail)
            + "; set embedder.runtime: torch to serve it with sentence-transformers"
        )
    return target


def export(model_dir: Path, target: Path, precision: Precision) -> float:
    """Blocking, and importing torch: write the graph to ``target`` atomically; returns
    the largest 1 - cosine to sentence-transformers on the probes."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(model_dir), device="cpu").eval()
    transformer = model[0].auto_model
    assert isinstance(transformer, torch.nn.Module)

    class SentenceEmbedding(torch.nn.Module):
        def __init__(self, transformer: torch.nn.Module) -> None:
            super().__init__()
            self.transformer = transformer  # a submodule: its weights go in the graph

        def forward(
            self,
            input_ids: torch.Tensor,
            attention_mask: torch.Tensor,
            token_type_ids: torch.Tensor,
        ) -> torch.Tensor:
            hidden = self.transformer(
                input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
            ).last_hidden_state
            weights = attention_mask.unsqueeze(-1).to(hidden.dtype)
            mean = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
            return torch.nn.functional.normalize(mean, p=2, dim=1)

    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    float_graph = partial.with_suffix(".fp32")
    example = tuple(torch.ones(2, 8, dtype=torch.long) for _ in INPUTS)
    axes = {name: {0: "batch", 1: "tokens"} for name in INPUTS}
    try:
        with torch.no_grad():
            torch.onnx.export(
                SentenceEmbedding(transformer).eval(),
                example,
                str(float_graph),
                input_names=list(INPUTS),
                output_names=["embedding"],
                dynamic_axes={**axes, "embedding": {0: "batch"}},
                opset_version=17,
                dynamo=False,  # the TorchScript exporter needs neither onnxscript nor a trace
            )
        if precision == "int8":
            _quantize(float_graph, partial)
        else:
            os.replace(float_graph, partial)
        expected = model.encode(list(_PROBES), normalize_embeddings=True, convert_to_numpy=True)
        worst = _worst_disagreement(model_dir, partial, expected)
        if worst > _AGREEMENT[precision]:
            raise ExportFailed(
                f"the {precision} graph disagrees with sentence-transformers: "
                f"1 - cosine {worst:.5f} > {_AGREEMENT[precision]}"
            )
        os.replace(partial, target)
        return worst
    finally:
        partial.unlink(missing_ok=True)
        float_graph.unlink(missing_ok=True)


def _quantize(source: Path, target: Path) -> None:
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    graph = onnx.load(str(source))
    ffn_outputs = [
        node.name
        for node in graph.graph.node
        if node.op_type == "MatMul"
        and node.name.endswith("/output/dense/MatMul")
        and "/attention/" not in node.name
    ]
    quantize_dynamic(
        str(source),
        str(target),
        weight_type=QuantType.QInt8,
        per_channel=True,
        op_types_to_quantize=["MatMul"],
        nodes_to_exclude=ffn_outputs,
    )


def _worst_disagreement(model_dir: Path, graph: Path, expected: object) -> float:
    import numpy as np

    from router.onnx_runtime import OnnxSentenceEncoder

    encoder = OnnxSentenceEncoder(model_dir, graph, threads=1)
    got = encoder.encode(list(_PROBES))
    cosines = (got * np.asarray(expected, dtype=np.float32)).sum(axis=1)
    return float(1.0 - cosines.min())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("target", type=Path)
    parser.add_argument("--precision", choices=("fp32", "int8"), default="fp32")
    args = parser.parse_args(argv)
    try:
        worst = export(args.model_dir, args.target, args.precision)
    except ExportFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"{args.target}: 1 - cosine to sentence-transformers at most {worst:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
