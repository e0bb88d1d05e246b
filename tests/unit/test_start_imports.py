"""What a server's lighter processes import as they start: torch costs each of them seconds
of CPU (on a 2-core machine, seconds of every start), so the front and the detokenizer must
get their tokenizer and the platform's argument defaults without it; and transformers
(~1 s more) is left to the processes that render chat templates: the scheduler's tokenizer
goes without it."""

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


DECODER_PROBE = """
import sys
from cadence.detokenizer.process import run_detokenizer_process
from cadence.model_loader.locate import default_model_path
from cadence.model_loader.tokenizer_files import TokenDecoder, load_decoder

decoder = load_decoder(default_model_path())
assert isinstance(decoder, TokenDecoder)
print(decoder.decode([19556, 905]), "|", sorted(m for m in ("torch", "transformers") if m in sys.modules))
"""


def test_the_detokenizer_decodes_a_gguf_conversion_without_transformers():
    done = subprocess.run(
        [sys.executable, "-c", DECODER_PROBE], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    text, imported = done.stdout.strip().splitlines()[-1].split(" | ")
    assert text.strip() and imported == "[]", done.stdout


def test_the_decoder_decodes_exactly_as_the_tokenizer_does():
    """Random ids (special tokens, byte pieces that split a character, plain words), with
    and without skip_special_tokens: the `tokenizers`-only decoder and transformers' decode
    give the same text."""
    import random

    from cadence.model_loader.locate import default_model_path
    from cadence.model_loader.tokenizer_files import TokenDecoder, load_decoder, load_tokenizer

    path = default_model_path()
    decoder, tokenizer = load_decoder(path), load_tokenizer(path)
    assert isinstance(decoder, TokenDecoder)
    rng = random.Random(7)
    vocab = tokenizer.vocab_size
    special = tokenizer.all_special_ids
    text = "Hello, world! Ça va? 你好 🙂 <|im_start|>user\n def f(x):\n\treturn x  # done"
    cases = [tokenizer.encode(text), tokenizer.encode(text)[:7], []]
    for _ in range(200):
        n = rng.randint(1, 24)
        cases.append(
            [rng.choice(special) if rng.random() < 0.2 else rng.randrange(vocab) for _ in range(n)]
        )
    for ids in cases:
        for skip in (False, True):
            assert decoder.decode(ids, skip_special_tokens=skip) == tokenizer.decode(
                ids, skip_special_tokens=skip
            ), (ids, skip)


def test_a_tokenizer_that_cleans_up_spaces_is_decoded_by_transformers(tmp_path):
    """A tokenizer whose config asks for transformers' clean-up of spaces gets no
    `tokenizers`-only decoder, unless it is BPE (transformers skips the clean-up there)."""
    import json
    import os
    import shutil

    from cadence.model_loader.locate import default_model_path
    from cadence.model_loader.tokenizer_files import decodes_alone, tokenizer_dir

    source = tokenizer_dir(default_model_path())
    for name in os.listdir(source):
        shutil.copy(os.path.join(source, name), tmp_path)
    config_path, spec_path = tmp_path / "tokenizer_config.json", tmp_path / "tokenizer.json"
    assert decodes_alone(str(tmp_path))
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "clean_up_tokenization_spaces": True}))
    assert decodes_alone(str(tmp_path))  # BPE
    spec = json.loads(spec_path.read_text())
    spec_path.write_text(json.dumps({**spec, "model": {**spec["model"], "type": "WordPiece"}}))
    assert not decodes_alone(str(tmp_path))
    config_path.write_text(json.dumps({**config, "tokenizer_class": "BertTokenizer"}))
    assert not decodes_alone(str(tmp_path))


SCHEDULER_PROBE = """
import sys
from cadence.model_loader.locate import default_model_path
from cadence.model_loader.tokenizer_files import LightTokenizer, load_scheduler_tokenizer
from cadence.scheduler.sessions import auto_bos

tokenizer = load_scheduler_tokenizer(default_model_path())
assert isinstance(tokenizer, LightTokenizer)
print(tokenizer.eos_token_id, auto_bos(tokenizer), "|", "transformers" in sys.modules)
"""


def test_the_scheduler_gets_its_tokenizer_without_transformers():
    done = subprocess.run(
        [sys.executable, "-c", SCHEDULER_PROBE], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    ids, imported = done.stdout.strip().splitlines()[-1].split(" | ")
    assert imported == "False", done.stdout
    assert ids.split()[0].isdigit(), done.stdout  # the EOS id was found


def test_the_scheduler_tokenizer_answers_as_transformers_does():
    """The special ids, `encode` (and so whether a BOS leads every text) and `decode` of the
    `tokenizers`-only tokenizer equal transformers' on the default model; the grammar engine
    gets transformers' own tokenizer, loaded once."""
    from cadence.model_loader.locate import default_model_path
    from cadence.model_loader.tokenizer_files import (
        LightTokenizer,
        load_scheduler_tokenizer,
        load_tokenizer,
    )
    from cadence.scheduler.sessions import auto_bos

    path = default_model_path()
    light, whole = load_scheduler_tokenizer(path), load_tokenizer(path)
    assert isinstance(light, LightTokenizer)
    assert (light.eos_token_id, light.bos_token_id) == (whole.eos_token_id, whole.bos_token_id)
    assert light.eos_token_id is not None
    assert auto_bos(light) == auto_bos(whole)
    for text in ["a", "", "Hello, world! Ça va? 你好 🙂", "<|im_start|>user\nhi<|im_end|>\n"]:
        assert light.encode(text) == whole.encode(text), text
        ids = whole.encode(text)
        assert light.decode(ids) == whole.decode(ids)
    full = light.transformers_tokenizer()
    assert type(full) is type(whole) and light.transformers_tokenizer() is full


def test_a_tokenizer_that_adds_special_tokens_is_the_whole_transformers_one(tmp_path):
    """Where transformers would rewrite what `encode` adds (add_bos_token in the config) or
    reads its special tokens from a separate map, the scheduler gets transformers' tokenizer."""
    import json
    import os
    import shutil

    from cadence.model_loader.locate import default_model_path
    from cadence.model_loader.tokenizer_files import (
        LightTokenizer,
        is_light_exact,
        load_scheduler_tokenizer,
        tokenizer_dir,
    )

    source = tokenizer_dir(default_model_path())
    for name in os.listdir(source):
        shutil.copy(os.path.join(source, name), tmp_path)
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    assert is_light_exact(str(tmp_path))
    config_path.write_text(json.dumps({**config, "add_bos_token": True}))
    assert not is_light_exact(str(tmp_path))
    whole = load_scheduler_tokenizer(str(tmp_path), str(tmp_path))
    assert not isinstance(whole, LightTokenizer)
    assert hasattr(whole, "apply_chat_template")  # transformers' own
    config_path.write_text(json.dumps(config))
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    assert not is_light_exact(str(tmp_path))
    os.remove(tmp_path / "special_tokens_map.json")
    config_path.write_text(json.dumps({**config, "eos_token": "<|no such token|>"}))
    assert not is_light_exact(str(tmp_path))
