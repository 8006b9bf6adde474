"""Everything jaxrl needs to run with ``google-jetstream`` 0.2.2 on current JAX, in one place: its engine API (the
real one when it imports, else stand-ins with the same names, fields and abstract methods), and the two documented
shims that let its orchestrator load.

``google-jetstream`` 0.2.2 is the last release (2024; the repository is archived upstream). Two things stop it from
importing on a current, TensorFlow-free install, and this module deals with both and nothing else:

1. **seqio stand-in.** ``jetstream.engine.token_utils`` (imported by ``engine_api``) imports
   ``seqio.vocabularies``, and ``seqio`` pulls TensorFlow (~2.4 GB). jaxrl's engine builds its own tokenizer, so
   when ``seqio`` is not installed this module registers a two-class stand-in for ``seqio.vocabularies``
   (``Vocabulary``, ``SentencePieceVocabulary``: the only names JetStream imports) in ``sys.modules`` before it
   imports JetStream. A real ``seqio`` is always preferred.
2. **jax.tree_map shim.** JetStream's orchestrator frees each prefix after ``insert`` with ``jax.tree_map``, which
   JAX removed (0.6). :func:`load_orchestrator` points that module's own ``jax`` name at a read-through view of
   ``jax`` that adds ``tree_map = jax.tree.map``. The ``jax`` module itself is not touched; nothing else in the
   process sees the view.

Install: ``bash scripts/setup_jetstream.sh`` (``pip install --no-deps google-jetstream==0.2.2`` plus the
``jetstream`` extra's pure-Python dependencies; README "Rollout engines").

Attributes:
  AVAILABLE: True when ``jetstream.engine.engine_api`` imported.
  IMPORT_ERROR: why it did not (``None`` when it did, or the one-line reason).
  Engine, ResultTokens, SlotData: JetStream's classes, or the stand-ins below.
  TokenizerParameters: ``tokenizer_pb2.TokenizerParameters`` or a small dataclass with the same fields.
  Tokenizer: JetStream's ``tokenizer_api.Tokenizer`` base, or the stand-in.
"""

from __future__ import annotations

import abc
import dataclasses
import importlib.util
import sys
import types
from typing import Any

import jax
import numpy as np

__all__ = ["AVAILABLE", "IMPORT_ERROR", "Engine", "ResultTokens", "SlotData", "Tokenizer", "TokenizerParameters",
           "load_orchestrator"]


def _install_seqio_stand_in() -> None:
    """Register ``seqio`` / ``seqio.vocabularies`` with the two classes JetStream 0.2.2 imports, unless a real
    ``seqio`` is installed (then nothing happens)."""
    if "seqio" in sys.modules or importlib.util.find_spec("seqio") is not None:
        return

    class Vocabulary:  # what jetstream.engine.mock_utils subclasses; never instantiated by jaxrl
        """Stand-in for ``seqio.vocabularies.Vocabulary`` (jaxrl: real seqio is not installed)."""

    class SentencePieceVocabulary(Vocabulary):
        """Stand-in for ``seqio.vocabularies.SentencePieceVocabulary``: refuses to load."""

        def __init__(self, *args, **kwargs):
            raise RuntimeError(
                "seqio is not installed (jaxrl's JetStream extra avoids it: it pulls TensorFlow); JetStream's "
                "SentencePieceTokenizer needs it. jaxrl's JetStreamEngine.build_tokenizer does not: use it, or "
                "`pip install seqio`"
            )

    vocabularies = types.ModuleType("seqio.vocabularies", "jaxrl stand-in: seqio is not installed")
    vocabularies.Vocabulary = Vocabulary
    vocabularies.SentencePieceVocabulary = SentencePieceVocabulary
    Vocabulary.__module__ = SentencePieceVocabulary.__module__ = "seqio.vocabularies"
    seqio = types.ModuleType("seqio", "jaxrl stand-in: only seqio.vocabularies' two classes JetStream imports")
    seqio.vocabularies = vocabularies
    sys.modules["seqio"] = seqio
    sys.modules["seqio.vocabularies"] = vocabularies


def _import_jetstream():
    """``(engine_api, tokenizer_api, tokenizer_pb2)`` from google-jetstream, or the one-line reason it failed."""
    if importlib.util.find_spec("jetstream") is None:
        return None, "google-jetstream is not installed (bash scripts/setup_jetstream.sh)"
    _install_seqio_stand_in()
    try:
        from jetstream.engine import engine_api, tokenizer_api, tokenizer_pb2
    except Exception as e:  # a broken install: missing deps (grpc, tiktoken, ...), protobuf mismatch
        return None, f"google-jetstream is installed but does not import: {type(e).__name__}: {e}"
    return (engine_api, tokenizer_api, tokenizer_pb2), None


class _JaxWithTreeMap(types.ModuleType):
    """``jax`` as JetStream 0.2.2's orchestrator expects it: every attribute from ``jax``, plus ``tree_map``."""

    def __init__(self):
        super().__init__("jax", "jax, plus the removed jax.tree_map, for JetStream 0.2.2's orchestrator only")
        self.tree_map = jax.tree.map

    def __getattr__(self, name):
        return getattr(jax, name)


def load_orchestrator():
    """JetStream's ``jetstream.core.orchestrator`` module, its ``jax.tree_map`` call working on current JAX (shim 2
    above). Importing it also sets the root logger to DEBUG with a stdout handler (JetStream's module does that).

    Raises:
      ImportError: google-jetstream is not installed or does not import (the message says why and how to
        install it).
    """
    if not AVAILABLE:
        raise ImportError(IMPORT_ERROR)
    from jetstream.core import orchestrator

    if not hasattr(jax, "tree_map") and not isinstance(orchestrator.jax, _JaxWithTreeMap):
        orchestrator.jax = _JaxWithTreeMap()
    return orchestrator


_modules, IMPORT_ERROR = _import_jetstream()
AVAILABLE = _modules is not None

if AVAILABLE:
    _engine_api, _tokenizer_api, _tokenizer_pb2 = _modules
    Engine = _engine_api.Engine
    ResultTokens = _engine_api.ResultTokens
    SlotData = _engine_api.SlotData
    Tokenizer = _tokenizer_api.Tokenizer
    TokenizerParameters = _tokenizer_pb2.TokenizerParameters
else:

    @dataclasses.dataclass
    class SlotData:
        """One slot's part of a :class:`ResultTokens` (JetStream's ``SlotData``): tokens / valid ``[samples,
        1]``, lengths ``[samples]``."""

        tokens: Any
        valid: Any
        lengths: Any

    @dataclasses.dataclass
    class ResultTokens:
        """JetStream's ``ResultTokens`` without JetStream: one ``[slots, columns]`` array (one device->host copy)
        and the column ranges of tokens, validity and lengths."""

        data: Any
        tokens_idx: tuple[int, int]
        valid_idx: tuple[int, int]
        length_idx: tuple[int, int]
        samples_per_slot: int

        def copy_to_host_async(self) -> None:
            if not isinstance(self.data, np.ndarray):
                self.data.copy_to_host_async()

        def convert_to_numpy(self) -> "ResultTokens":
            return dataclasses.replace(self, data=np.asarray(self.data))

        def get_result_at_slot(self, slot: int) -> SlotData:
            rows = slice(slot * self.samples_per_slot, (slot + 1) * self.samples_per_slot)
            return SlotData(
                tokens=self.data[rows, self.tokens_idx[0]: self.tokens_idx[1]],
                valid=self.data[rows, self.valid_idx[0]: self.valid_idx[1]],
                lengths=self.data[rows, self.length_idx[0]: self.length_idx[1]][:, 0],
            )

    class Engine(abc.ABC):
        """JetStream's ``Engine`` interface (0.2.2) without JetStream: the abstract methods an engine provides."""

        @abc.abstractmethod
        def prefill(self, *, params, existing_prefix=None, padded_tokens, true_length):
            """One prompt -> a prefix (its KV cache, ...)."""

        @abc.abstractmethod
        def generate(self, params, decode_state):
            """One token for every decode slot -> ``(decode_state, ResultTokens)``."""

        @abc.abstractmethod
        def insert(self, prefix, decode_state, slot: int):
            """Put a prefix into decode slot ``slot``."""

        @abc.abstractmethod
        def load_params(self, *args, **kwargs):
            """The weights."""

        @abc.abstractmethod
        def get_prefix_destination_sharding(self):
            """Where a prefix goes before ``insert``."""

        @abc.abstractmethod
        def get_tokenizer(self):
            """What ``build_tokenizer`` needs."""

        def build_tokenizer(self, metadata):
            raise NotImplementedError

        @abc.abstractmethod
        def init_decode_state(self, *args, **kwargs):
            """A fresh decode state (every slot free)."""

        @property
        @abc.abstractmethod
        def max_concurrent_decodes(self) -> int: ...

        @property
        @abc.abstractmethod
        def samples_per_slot(self) -> int: ...

        @property
        @abc.abstractmethod
        def max_prefill_length(self) -> int: ...

        @property
        @abc.abstractmethod
        def mesh(self): ...

        @property
        @abc.abstractmethod
        def colocated_cpus(self): ...

    class Tokenizer(abc.ABC):
        """JetStream's ``tokenizer_api.Tokenizer`` without JetStream."""

        @abc.abstractmethod
        def encode(self, s: str, **kwargs): ...

        @abc.abstractmethod
        def decode(self, token_ids: list[int], **kwargs) -> str: ...

        @property
        @abc.abstractmethod
        def pad_id(self) -> int: ...

        @property
        @abc.abstractmethod
        def eos_id(self) -> int: ...

        @property
        @abc.abstractmethod
        def bos_id(self) -> int: ...

        @property
        def stop_tokens(self) -> set[int]:
            return {self.eos_id, self.pad_id}

    @dataclasses.dataclass
    class TokenizerParameters:
        """``tokenizer_pb2.TokenizerParameters`` without protobuf."""

        path: str = ""
        extra_ids: int = 0
