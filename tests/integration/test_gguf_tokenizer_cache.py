"""The default model's GGUF tokenizer is converted once, however many processes ask for it at
the same moment (a server's front, scheduler and detokenizer; servers started together), and
what they read is a whole conversion."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ASK = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
from cadence.model_loader import default_model_path
from cadence.model_loader.tokenizer_files import converted_tokenizer_dir
from cadence.model_loader.tokenizer_files import load_tokenizer
path = default_model_path()
print(converted_tokenizer_dir(path))
print(len(load_tokenizer(path)("hello world")["input_ids"]))
"""


def ask_together(cache: str, count: int) -> list[tuple[str, str]]:
    """(stdout, stderr) of `count` processes asking for the tokenizer at once."""
    env = dict(os.environ, CADENCE_CACHE_DIR=cache)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", ASK],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(count)
    ]
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
    return outs


def test_processes_starting_together_convert_once_and_read_the_same(tmp_path):
    outs = ask_together(str(tmp_path), 3)
    conversions = sum(err.count("Converting the GGUF tokenizer") for _, err in outs)
    assert conversions == 1, [err[-500:] for _, err in outs]
    dirs = {out.splitlines()[0] for out, _ in outs}
    counts = {out.splitlines()[1] for out, _ in outs}
    assert len(dirs) == 1 and len(counts) == 1 and int(counts.pop()) > 0
    (target,) = dirs
    assert os.path.exists(os.path.join(target, "tokenizer.json"))
    # Nothing half-written is left beside it, only the conversion and its lock file.
    names = sorted(os.listdir(os.path.dirname(target)))
    assert names == sorted([os.path.basename(target), os.path.basename(target) + ".lock"])

    (out, err), = ask_together(str(tmp_path), 1)  # fmt: skip
    assert "Converting" not in err and out.splitlines()[0] == target


def test_a_directory_without_a_conversion_is_converted_over(tmp_path):
    """What an interrupted conversion of an older version could leave: not a tokenizer."""
    from cadence.model_loader import default_model_path
    from cadence.model_loader.tokenizer_files import file_key

    stale = tmp_path / "tokenizers" / file_key(default_model_path())
    stale.mkdir(parents=True)
    (stale / "special_tokens_map.json").write_text("{}")
    (out, err), = ask_together(str(tmp_path), 1)  # fmt: skip
    assert err.count("Converting the GGUF tokenizer") == 1
    assert os.path.exists(stale / "tokenizer.json") and out.splitlines()[0] == str(stale)
