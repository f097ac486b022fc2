"""Byte-level data for the GPT example: no tokenizer, no network.

Tokens are raw bytes (ids 0..255, ``VOCAB_SIZE = 256``). Documents are joined with a NUL
byte (``DOC_SEPARATOR``), which never occurs in text files, so the vocabulary stays 256
and bits-per-byte is simply ``loss / ln 2``.

The default corpus is the Python standard library's own source code (the ``*.py`` files
under ``sysconfig.get_paths()["stdlib"]``, test suites, codec tables and installed
packages left out), read in sorted path order and capped at ``DEFAULT_MAX_BYTES``.
``load_corpus(path)`` reads a text file, or every text file under a directory instead.

``ByteDataset`` holds the corpus split into train and validation bytes. Training batches
are a pure function of ``(seed, step)``, so resuming a run only needs the step number.
Validation uses a fixed list of contiguous windows from the held-out tail.
"""

from __future__ import annotations

import codecs
import dataclasses
import hashlib
import math
import os
import sysconfig
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

VOCAB_SIZE = 256
DOC_SEPARATOR = b"\x00"
DEFAULT_MAX_BYTES = 8 * 1024 * 1024

# Directories of the standard library skipped by the default corpus: test suites and the
# generated codec tables are large and unlike ordinary code; site-packages differs between
# machines.
_STDLIB_SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "encodings", "__pycache__"}
)


def _looks_like_text(data: bytes, whole: bool = True) -> bool:
    """No NUL byte in the first 8 KiB, and valid UTF-8; ``whole=False``: ``data`` is a
    prefix, whose last character may be cut."""
    if b"\x00" in data[:8192]:
        return False
    decoder, view, chunk = codecs.getincrementaldecoder("utf-8")(), memoryview(data), 1 << 20
    try:  # in chunks: the decoded text of a whole file would double the memory
        for start in range(0, len(data), chunk):
            decoder.decode(view[start:start + chunk])
        decoder.decode(b"", final=whole)
    except UnicodeDecodeError:
        return False
    return True


def _read(path: Path, limit: int | None) -> tuple[bytes, bool]:
    """``(at most limit bytes of path, whether that is the whole file)``: a bounded read,
    so --max-bytes bounds the memory too."""
    with open(path, "rb") as f:
        if limit is None:
            return f.read(), True
        # Not read(limit) itself: Python allocates the whole limit up front.
        data = f.read(min(limit, os.fstat(f.fileno()).st_size))
        return data, not f.read(1)


def available_memory() -> int | None:
    """Bytes of memory free for new allocations (Linux's ``MemAvailable``), else the free
    physical pages; None where neither is known."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def check_memory(size: int, what: str) -> None:
    """Refuses, before reading, ``size`` bytes of data that would not fit in the free
    memory: the read, the join and the split hold about twice the corpus at once."""
    free = available_memory()
    if free is not None and 2 * size > free:
        raise ValueError(f"{what} holds {size:,} bytes; reading it whole needs about twice "
                         f"that, but {free:,} bytes of memory are free: read only a part of it "
                         f"with --max-bytes (e.g. --max-bytes {max(1, free // 4):d})")


def _join(paths: list[Path], max_bytes: int | None, *, check_text: bool) -> tuple[bytes, int, int]:
    """``(corpus, files read, files skipped as not text)``; stops once ``max_bytes`` are read."""
    chunks, total, skipped = [], 0, 0
    for p in paths:
        data, whole = _read(p, None if max_bytes is None else max_bytes - total)
        if check_text and not _looks_like_text(data, whole):
            skipped += 1
            continue
        chunks.append(data)
        total += len(data) + len(DOC_SEPARATOR)
        if max_bytes is not None and total >= max_bytes:
            break
    corpus = DOC_SEPARATOR.join(chunks)
    if max_bytes is not None:
        corpus = corpus[:max_bytes]
    return corpus, len(chunks), skipped


def stdlib_corpus(max_bytes: int | None = DEFAULT_MAX_BYTES) -> bytes:
    """The default corpus: Python standard library sources, deterministic for one Python."""
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(
        p
        for p in root.rglob("*.py")
        if not _STDLIB_SKIP_DIRS.intersection(p.relative_to(root).parts[:-1])
    )
    corpus, _, _ = _join(paths, max_bytes, check_text=True)
    if not corpus:
        raise FileNotFoundError(f"found no Python sources under the standard library at {root}")
    return corpus


@dataclasses.dataclass(frozen=True)
class Corpus:
    """The bytes of a corpus and where they came from."""

    data: bytes
    source: str          # the file or directory read, or the standard library's root
    files_read: int = 1
    files_skipped: int = 0  # not text (NUL bytes or invalid UTF-8), in a directory

    @property
    def fingerprint(self) -> str:
        """What was read, for ``--resume`` to recognise: its size and SHA-256."""
        return f"{len(self.data)} bytes, sha256 {hashlib.sha256(self.data).hexdigest()}"

    def describe(self) -> str:
        """One line: what was read, and how many files were skipped."""
        line = f"{len(self.data):,} bytes from {self.source}"
        if self.files_read > 1 or self.files_skipped:
            line += f" ({self.files_read:,} text files"
            if self.files_skipped:
                line += f"; {self.files_skipped:,} skipped: binary or not UTF-8"
            line += ")"
        return line


def read_corpus(path: str | os.PathLike | None = None, max_bytes: int | None = None) -> Corpus:
    """Like :func:`load_corpus`, with the source and the count of files read and skipped.

    A single file must be text (no NUL bytes, valid UTF-8), the rule that a directory's
    files are filtered by; a directory skips its other files and counts them.
    """
    if max_bytes is not None and max_bytes < 1:
        raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
    if path is None:
        root = sysconfig.get_paths()["stdlib"]
        data = stdlib_corpus(DEFAULT_MAX_BYTES if max_bytes is None else max_bytes)
        return Corpus(data, f"the Python standard library at {root}")
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"data path {str(p)!r} does not exist")
    if p.is_file():
        if max_bytes is None:
            check_memory(p.stat().st_size, f"data file {str(p)!r}")
        data, whole = _read(p, max_bytes)
        if not data:
            raise ValueError(f"data file {str(p)!r} is empty")
        if not _looks_like_text(data, whole):
            raise ValueError(f"data file {str(p)!r} is not text (it holds NUL bytes or is not "
                             f"UTF-8); give a text file or a directory of them")
        return Corpus(data, str(p))
    if not p.is_dir():
        raise ValueError(f"data path {str(p)!r} is neither a regular file nor a directory (a "
                         f"FIFO, device or socket has no fixed content to train on and resume "
                         f"from); give a text file or a directory of them")
    files = sorted(
        f
        for f in p.rglob("*")
        if f.is_file() and not any(part.startswith(".") for part in f.relative_to(p).parts)
    )
    if max_bytes is None:
        check_memory(sum(f.stat().st_size for f in files), f"data directory {str(p)!r}")
    data, n_read, n_skipped = _join(files, max_bytes, check_text=True)
    if n_read == 0:
        raise ValueError(f"data directory {str(p)!r} holds no text files ({len(files)} files, "
                         f"{n_skipped} of them binary or not UTF-8)")
    return Corpus(data, str(p), n_read, n_skipped)


def load_corpus(path: str | os.PathLike | None = None, max_bytes: int | None = None) -> bytes:
    """Bytes of ``path`` (a text file, or all text files below a directory, sorted).

    ``path=None`` gives the standard-library corpus (capped at ``DEFAULT_MAX_BYTES`` unless
    ``max_bytes`` says otherwise). A file that is not text (NUL bytes or invalid UTF-8) is
    refused; under a directory such files, and hidden files/directories, are skipped.
    """
    return read_corpus(path, max_bytes).data


def bits_per_byte(loss: float) -> float:
    """Convert a mean cross-entropy in nats per byte-token into bits per byte."""
    return float(loss) / math.log(2)


class ByteDataset:
    """A byte corpus split into train and validation parts, with deterministic batches.

    ``batch(step)`` draws ``batch_size`` random windows of ``seq_len + 1`` bytes from the
    train split, seeded by ``(seed, step)``: the same step always gives the same batch, so
    a resumed run continues the data stream exactly by passing the next step.
    """

    source = "bytes given to the constructor"  # from_path: what was read (Corpus.describe)
    fingerprint = None  # from_path: Corpus.fingerprint, which --resume compares

    def __init__(
        self,
        corpus: bytes,
        *,
        batch_size: int,
        seq_len: int,
        val_frac: float = 0.05,
        seed: int = 0,
    ):
        if not 0.0 < val_frac < 1.0:
            raise ValueError(f"val_frac must be in (0, 1), got {val_frac}")
        if batch_size < 1 or seq_len < 1:
            raise ValueError(f"batch_size and seq_len must be >= 1, got {batch_size}, {seq_len}")
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed
        data = np.frombuffer(corpus, dtype=np.uint8)
        n_val = int(len(data) * val_frac)
        self.train = data[: len(data) - n_val]
        self.val = data[len(data) - n_val :]
        window = seq_len + 1
        # The train split needs one window; the validation split needs one full batch of
        # windows so that every validation batch has the same shape.
        need_train = window
        need_val = batch_size * window
        if len(self.train) < need_train or len(self.val) < need_val:
            need_total = max(math.ceil(need_val / val_frac), need_train + need_val)
            raise ValueError(
                f"corpus of {len(data):,} bytes is too small for batch_size={batch_size}, "
                f"seq_len={seq_len}: the train split has {len(self.train):,} bytes (needs "
                f">= {need_train:,}) and the validation split ({val_frac:.0%}) has "
                f"{len(self.val):,} bytes (needs >= {need_val:,} = batch_size * (seq_len+1)). "
                f"Use a corpus of at least {need_total:,} bytes, or lower --batch-size / "
                f"--seq-len."
            )

    @classmethod
    def from_path(
        cls,
        path: str | os.PathLike | None,
        *,
        batch_size: int,
        seq_len: int,
        max_bytes: int | None = None,
        **kwargs,
    ) -> ByteDataset:
        corpus = read_corpus(path, max_bytes)
        dataset = cls(corpus.data, batch_size=batch_size, seq_len=seq_len, **kwargs)
        dataset.source = corpus.describe()
        dataset.fingerprint = corpus.fingerprint
        return dataset

    def __repr__(self) -> str:
        return (
            f"ByteDataset(train={len(self.train):,} bytes, val={len(self.val):,} bytes, "
            f"batch_size={self.batch_size}, seq_len={self.seq_len}, seed={self.seed})"
        )

    @property
    def tokens_per_batch(self) -> int:
        return self.batch_size * self.seq_len

    def batch(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """Training inputs and targets for ``step``, each (batch_size, seq_len) int32."""
        rng = np.random.default_rng([self.seed, step])
        starts = rng.integers(0, len(self.train) - self.seq_len, size=self.batch_size)
        windows = self.train[starts[:, None] + np.arange(self.seq_len + 1)].astype(np.int32)
        return windows[:, :-1], windows[:, 1:]

    def num_val_batches(self) -> int:
        return len(self.val) // (self.batch_size * (self.seq_len + 1))

    def val_batches(
        self, max_batches: int | None = None
    ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Fixed validation batches: consecutive non-overlapping windows of the held-out tail."""
        n = self.num_val_batches()
        if max_batches is not None:
            n = min(n, max_batches)
        window = self.seq_len + 1
        per_batch = self.batch_size * window
        for i in range(n):
            chunk = self.val[i * per_batch : (i + 1) * per_batch]
            windows = chunk.reshape(self.batch_size, window).astype(np.int32)
            yield windows[:, :-1], windows[:, 1:]

    def evaluate(
        self,
        loss_on_batch: Callable[[np.ndarray, np.ndarray], float],
        max_batches: int | None = None,
    ) -> dict[str, float]:
        """Mean validation loss over the fixed batches, and the matching bits per byte.

        ``loss_on_batch(x, y)`` returns the mean loss of one batch, e.g. a jitted
        ``lambda x, y: loss_fn(model, x, y)``. All batches have equal size, so the mean of
        batch means is the mean over tokens.
        """
        losses = [float(loss_on_batch(x, y)) for x, y in self.val_batches(max_batches)]
        loss = float(np.mean(losses))
        return {"loss": loss, "bpb": bits_per_byte(loss), "batches": len(losses)}
