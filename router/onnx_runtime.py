"""Sentence embeddings from an exported graph (router.onnx_export): the model folder's
own tokenizer and one onnxruntime session, nothing else."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt

# sentence-transformers' own default, when the folder does not say.
_DEFAULT_MAX_TOKENS = 256


class OnnxSentenceEncoder:
    """Blocking: normalised float32 embeddings of a batch, as sentence-transformers
    makes them (the same tokens, padded to the batch's longest, the same pooling)."""

    def __init__(self, model_dir: Path, graph: Path, threads: int) -> None:
        import onnxruntime
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self._tokenizer.enable_truncation(max_length=_max_tokens(model_dir))
        self._tokenizer.no_padding()  # padded here, to the longest of each batch
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        # Idle pool threads would spin on the cores the event loop and the engines need.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self._session = onnxruntime.InferenceSession(
            str(graph), options, providers=["CPUExecutionProvider"]
        )
        self.dim = int(self._session.get_outputs()[0].shape[1])

    def encode(self, texts: Sequence[str]) -> npt.NDArray[np.float32]:
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        encodings = self._tokenizer.encode_batch(list(texts))
        longest = max(len(e.ids) for e in encodings)
        ids = np.zeros((len(encodings), longest), dtype=np.int64)
        mask = np.zeros_like(ids)
        for row, encoding in enumerate(encodings):
            ids[row, : len(encoding.ids)] = encoding.ids
            mask[row, : len(encoding.ids)] = 1
        feeds = {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}
        (vectors,) = self._session.run(["embedding"], feeds)
        return np.ascontiguousarray(vectors, dtype=np.float32)


def _max_tokens(model_dir: Path) -> int:
    config = model_dir / "sentence_bert_config.json"
    if not config.is_file():
        return _DEFAULT_MAX_TOKENS
    value = json.loads(config.read_text()).get("max_seq_length")
    return int(value) if isinstance(value, int) and value > 0 else _DEFAULT_MAX_TOKENS
