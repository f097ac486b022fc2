"""What a run leaves for people: ``log.jsonl``, ``config.json``, ``loss.png``, the summary.

``log.jsonl`` is strict JSON, one record per line: a loss that is not a finite number
(a diverged run) is written as ``null`` and named, with its value as text, in the
record's ``"nonfinite"`` entry, e.g. ``{"step": 7, "loss": null, "nonfinite":
{"loss": "nan"}, ...}``.
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path


def strict_record(record: dict) -> dict:
    """``record`` with non-finite floats replaced by None and listed under ``"nonfinite"``."""
    bad = {k: repr(v) for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)}
    if not bad:
        return record
    out = {k: (None if k in bad else v) for k, v in record.items()}
    out["nonfinite"] = bad
    return out


class LogError(ValueError):
    """``log.jsonl`` is damaged beyond a cut last line: one line for the user."""


class LogWriteError(Exception):
    """A record could not be written to ``log.jsonl`` (a full disk, a lost mount): one line."""


def read_records(path: Path) -> tuple[list[dict], str | None]:
    """``(records, cut)``: the records of ``log.jsonl``, and the text of its last line if
    that was cut off (a crash or a full disk while it was written: no newline, or not
    JSON), which is left out. Any other line that is not a JSON record raises ``LogError``."""
    lines = Path(path).read_bytes().split(b"\n")
    tail = lines.pop()  # after the last newline: b"" when the file ends with one
    records, cut = [], None
    if tail.strip():  # no newline after it: cut, unless it is a whole record
        try:
            json.loads(tail)
            lines.append(tail)
        except ValueError:
            cut = tail.decode(errors="replace")
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                raise ValueError("not a record with a step")
        except ValueError as e:
            if number == len(lines) and cut is None:  # the last line: cut, its newline kept
                cut = line.decode(errors="replace")
                break
            raise LogError(f"{path}: line {number} is not a log record ({e}); the log is "
                           f"damaged: repair or remove that line") from None
        records.append(record)
    return records, cut


def read_log(path: Path) -> list[dict]:
    """The records of ``log.jsonl`` (a cut last line left out)."""
    return read_records(path)[0]


class RunLog:
    """``log.jsonl`` of one run. On resume it keeps the records up to the start step.

    Only process 0 writes (``write=False`` elsewhere); every process keeps the records.
    ``cut``: the text of a cut last line found on resume and dropped (None: none).

    Each record goes out in one unbuffered write of its whole line, so a crash leaves at
    most the line being written cut, never a line held back in a buffer; a resume drops
    such a line. The kept records are rewritten to a temporary file that replaces the
    log, so a crash during the rewrite leaves the old log whole.
    """

    def __init__(self, path: Path, start: int, write: bool):
        self.path = path
        self.records, self.cut = [], None
        if start > 0 and path.exists():
            records, self.cut = read_records(path)
            self.records = [r for r in records if r["step"] <= start]
        self._file = None
        if write:
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_bytes(b"".join(self._line(r) for r in self.records))
            tmp.replace(path)
            self._file = open(path, "ab", buffering=0)

    @staticmethod
    def _line(record: dict) -> bytes:
        return (json.dumps(record, allow_nan=False) + "\n").encode()

    def write(self, record: dict) -> None:
        record = strict_record(record)
        self.records.append(record)
        if self._file is not None:
            data = memoryview(self._line(record))
            try:
                while data:  # one write; a loop only if the OS takes part of it
                    data = data[self._file.write(data):]
            except OSError as e:
                from checkpoints import write_problem

                raise LogWriteError(f"the record of step {record.get('step')} could not be "
                                    f"written to {self.path}: {write_problem(e)}; --resume "
                                    f"continues from the last checkpoint") from None

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def write_json(path: Path, value: dict) -> None:
    """Writes ``value`` as indented strict JSON, atomically (a reader never sees half)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=2, allow_nan=False) + "\n")
    tmp.replace(path)


def _smooth(values: list[float], weight: float = 0.9) -> list[float]:
    ema, out = None, []
    for v in values:
        ema = v if ema is None else weight * ema + (1 - weight) * v
        out.append(ema)
    return out


def _draw_run(ax, label: str, color, records: list[dict]) -> tuple[list[float], list[float]]:
    """Draws one run's curves; returns (low values, high values) for the y range."""
    train = [(r["step"], r["loss"]) for r in records if r.get("loss") is not None]
    val = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
    lows, highs = [], []
    if train:
        steps, losses = zip(*train)
        smooth = _smooth(losses)
        ax.plot(steps, losses, color=color, alpha=0.2, lw=0.7)
        ax.plot(steps, smooth, color=color, lw=1.4, label=f"{label}: train")
        lows.append(min(smooth))
    if val:
        steps, losses = zip(*val)
        ax.plot(steps, losses, color=color, ls="--", marker="o", ms=4, lw=1.2,
                label=f"{label}: val ({losses[-1]:.3f})")
        lows.append(min(losses))
        highs.append(losses[min(1, len(losses) - 1)])
    return lows, highs


def plot(runs: list[tuple[str, list[dict]]], path: Path, title: str, adamw_lr: float) -> None:
    """Train loss (raw, faint, and an EMA) and validation loss against steps, per optimizer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from PIL import Image

    colors = {"muon": "tab:blue", "adamw": "tab:orange"}
    labels = {"muon": "MuonAdamW (muon_optax)", "adamw": f"AdamW (optax, lr {adamw_lr:g})"}
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=100)
    lows, highs = [], []
    for name, records in runs:
        lo, hi = _draw_run(ax, labels.get(name, name), colors.get(name), records)
        lows += lo
        highs += hi
    if lows:
        lo = min(lows)
        hi = max(highs + [lo + 0.5])
        ax.set_ylim(lo - 0.05 * (hi - lo), hi + 0.3 * (hi - lo))
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / byte)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    # A 64-colour palette: the same picture at about a third of the bytes.
    buffer.seek(0)
    Image.open(buffer).convert("RGB").quantize(colors=64).save(path, optimize=True)


def _number(x, spec: str) -> str:
    return "non-finite" if x is None else format(x, spec)


def summary_lines(name: str, result: dict, tokens_per_step: int) -> list[str]:
    """The summary of one run: steps, speed, validation loss, where its files are."""
    val = [r for r in result["records"] if "val_loss" in r]
    steps = result["end"] - result["start"]
    line = f"  {name:>5}: {result['end']} steps"
    if steps:
        speed = steps * tokens_per_step / result["train_s"] if result["train_s"] else 0.0
        line += (f" ({steps} this run: {result['train_s']:.1f} s of steps, {speed:,.0f} "
                 f"tokens/s, compile {result['compile_s']:.1f} s)")
    lines = [line]
    if val:
        first, last = val[0], val[-1]
        lines.append(f"         val loss {_number(first['val_loss'], '.4f')} (step "
                     f"{first['step']}) -> {_number(last['val_loss'], '.4f')} (step "
                     f"{last['step']}); bits per byte {_number(first['val_bpb'], '.3f')} -> "
                     f"{_number(last['val_bpb'], '.3f')}")
    lines.append(f"         log {result['log']}, checkpoints {result['ckpt_dir']}")
    return lines
