"""What a server's lighter processes import as they start: torch costs each of them seconds
of CPU (on a 2-core machine, seconds of every start), so the front and the detokenizer must
get their tokenizer and the platform's argument defaults without it."""

from __future__ import annotations

import subprocess
import sys

from cadence.platforms.builtin import _torch_built_with_cuda

PROBE = """
import sys
from cadence.detokenizer.process import run_detokenizer_process
from cadence.front_process import run_front_process
from cadence.hooks import finalize_server_args
from cadence.model_loader.locate import default_model_path
from cadence.model_loader.tokenizer_files import load_tokenizer
from cadence.server_args import ServerArgs

tokenizer = load_tokenizer(default_model_path())
assert tokenizer.decode(tokenizer.encode("hello world")) == "hello world"
finalize_server_args(ServerArgs())
print(sorted(m for m in ("torch", "transformers.models.auto") if m in sys.modules))
"""


def test_the_front_and_the_detokenizer_start_without_torch():
    done = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    imported = done.stdout.strip().splitlines()[-1]
    # A torch built with CUDA is imported to ask whether a GPU is there: that is its job.
    expected = "[]" if not _torch_built_with_cuda() else imported
    assert imported == expected, f"imported {imported} while starting"


def test_the_cuda_build_check_reads_torchs_version_file():
    import torch

    assert _torch_built_with_cuda() == (torch.version.cuda is not None)
