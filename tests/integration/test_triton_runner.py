"""The CUDA platform's Triton layers (attention straight from the pool, rotary with the K/V
store, fused norms) inside the model runner, on the CPU through Triton's interpreter: a
small random Llama computes the same logits through them as through the portable torch
layers, for a prefill, a prefill chunk over a cached prefix, decode steps and a verify
step with drafts. Skipped, with the reason printed, where triton does not install."""

from __future__ import annotations

import contextlib
import json
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed on this machine")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the Triton layers run on the CPU only interpreted", allow_module_level=True)

from cadence.layers.attention import TorchNativeBackend  # noqa: E402
from cadence.layers.layer_ops import LayerOps  # noqa: E402
from cadence.layers.linear import Linear  # noqa: E402
from cadence.layers.triton_layers import TritonBackend, TritonOps  # noqa: E402
from cadence.model_executor import model_runner as runner_module  # noqa: E402
from cadence.model_executor.runner import BatchItem  # noqa: E402
from cadence.platforms.cpu import CpuPlatform  # noqa: E402
from cadence.server_args import ServerArgs  # noqa: E402

HIDDEN, HEADS, KV_HEADS, LAYERS, VOCAB, INTER = 64, 4, 2, 2, 96, 80


class _CpuWith(CpuPlatform):
    """The CPU platform with the given attention backend and layer ops, and plain
    projections (no CPU kernels)."""

    backend: type = TorchNativeBackend
    ops: type = LayerOps

    def make_attention_backend(self, kv_pool, num_heads, num_kv_heads, head_dim):
        return self.backend(kv_pool, num_heads, num_kv_heads, head_dim)

    def make_layer_ops(self):
        return self.ops()

    def make_linear(self, weight, bias=None):
        return Linear(weight, bias)


class TritonOnCpu(_CpuWith):
    """The CUDA platform's Triton layers, interpreted."""

    name = "triton-on-cpu"
    backend, ops = TritonBackend, TritonOps


class PlainCpu(_CpuWith):
    """The portable torch layers, the reference."""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A random Llama in Hugging Face's layout (config.json + model.safetensors)."""
    from safetensors.torch import save_file

    path = tmp_path_factory.mktemp("tiny-llama")
    head_dim = HIDDEN // HEADS
    config = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": HIDDEN,
        "intermediate_size": INTER,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "vocab_size": VOCAB,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
    }
    (path / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(3)
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (HEADS * head_dim, HIDDEN),
            p + "self_attn.k_proj.weight": (KV_HEADS * head_dim, HIDDEN),
            p + "self_attn.v_proj.weight": (KV_HEADS * head_dim, HIDDEN),
            p + "self_attn.o_proj.weight": (HIDDEN, HEADS * head_dim),
            p + "mlp.gate_proj.weight": (INTER, HIDDEN),
            p + "mlp.up_proj.weight": (INTER, HIDDEN),
            p + "mlp.down_proj.weight": (HIDDEN, INTER),
            p + "input_layernorm.weight": (HIDDEN,),
            p + "post_attention_layernorm.weight": (HIDDEN,),
        }
    tensors = {
        name: (
            torch.randn(shape, generator=g) * (0.3 if len(shape) == 2 else 0.05)
            + 1.0 * (len(shape) == 1)
        )
        for name, shape in shapes.items()
    }
    save_file(tensors, str(path / "model.safetensors"))
    return str(path)


@pytest.fixture(scope="module")
def runners(checkpoint):
    """One model runner per platform class, made once for the module (each test prefills
    the positions it reads before reading them, so they share the pools)."""
    made = {}

    def get(platform):
        if platform not in made:
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(runner_module, "get_current_platform", platform)
                args = ServerArgs(
                    dtype="float32", max_total_tokens=512, page_size=4, skip_warmup=True
                )
                made[platform] = runner_module.ModelRunner(args, checkpoint)
        return made[platform]

    return get


def _steps():
    """(is_decode, items) of a short conversation of two requests: prefills (one in two
    chunks, the second over the first's cached pages), decodes, a verify step."""
    a = list(range(1, 12))  # 11 tokens
    b = [5, 9, 2, 40, 33, 17]
    pa, pb = [3, 7, 1, 9, 12], [20, 4, 6]
    return [
        (False, [BatchItem("a", 1, a[:6], 0, pa), BatchItem("b", 2, b, 0, pb)]),
        (False, [BatchItem("a", 1, a[6:], 6, pa)]),
        (True, [BatchItem("a", 1, [50], 11, pa), BatchItem("b", 2, [51], 6, pb)]),
        (True, [BatchItem("a", 1, [52], 12, pa), BatchItem("b", 2, [53], 7, pb)]),
        (
            True,
            [BatchItem("a", 1, [54, 55, 56], 13, pa, num_draft=2), BatchItem("b", 2, [57], 8, pb)],
        ),
    ]


def _logits(runner, is_decode, items):
    if is_decode:
        return runner._forward_decode(items, {})
    for item in items:
        item.logprob_rows = list(range(len(item.token_ids)))
    return runner._forward_extend(items, {})


def test_triton_layers_compute_the_torch_layers_logits(runners):
    ours, ref = runners(TritonOnCpu), runners(PlainCpu)
    assert type(ours.attn).__name__ == "TritonBackend" and ours.kv_pool.scratch_page is None
    for is_decode, items in _steps():
        got = _logits(ours, is_decode, items)
        want = _logits(ref, is_decode, items)
        assert got.shape == want.shape and got.shape[0] == sum(len(i.token_ids) for i in items)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


class ReplayedEagerly:
    """`DecodeGraphs` with each bucket's 'graph' a closure that reruns the captured forward
    on the same static buffers and writes the same output tensor: everything but the CUDA
    capture itself (bucket choice, the static inputs, padding rows on the scratch page)."""

    @staticmethod
    def make(runner):
        from cadence.platforms.cuda_graph import DecodeGraphs

        class Graphs(DecodeGraphs):
            WARMUPS = 0  # nothing to compile or settle here
            replays: list[int] = []

            @contextlib.contextmanager
            def _capture_stream(self):
                yield None

            def _capture_one(self, batch, stream):
                out = self._forward(batch)

                def replay():
                    self.replays.append(batch.batch_size)
                    out.copy_(self._forward(batch))

                return replay, out

        return Graphs(
            runner.model, runner.kv_pool, runner.context_len, 4, runner.device, runner.future_ids
        )


class GraphsOnCpu(TritonOnCpu):
    def support_cuda_graph(self):
        return True

    def make_kv_pool(self, num_pages, page_size, num_layers, num_kv_heads, head_dim, dtype):
        from cadence.mem_cache.kv_pool import KVPool

        return KVPool(num_pages, page_size, num_layers, num_kv_heads, head_dim, dtype, "cpu", True)

    def make_graph_runner(self, model_runner):
        return ReplayedEagerly.make(model_runner)


def test_decode_graphs_pad_batches_into_the_scratch_page(runners):
    ours, ref = runners(GraphsOnCpu), runners(PlainCpu)
    graphs = ours.graphs
    assert graphs.buckets == [1, 2, 4] and ours.kv_pool.scratch_page == 128
    # Three requests decode in a bucket of 4, then two in a bucket of 2, then one alone.
    prompts = {"a": [1, 2, 3, 4, 5, 6, 7], "b": [8, 9, 10], "c": list(range(20, 33))}
    pages = {"a": [9, 2, 40], "b": [17, 5], "c": [30, 31, 32, 33, 34]}
    starts = {}
    for runner in (ours, ref):
        items = [BatchItem(r, i, ids, 0, pages[r]) for i, (r, ids) in enumerate(prompts.items())]
        _logits(runner, False, items)
    starts = {r: len(ids) for r, ids in prompts.items()}
    for live in (["a", "b", "c"], ["a", "b", "c"], ["a", "c"], ["c"], ["c"]):
        graphs.replays.clear()
        logits = []
        for runner in (ours, ref):
            items = [BatchItem(r, ord(r), [60 + starts[r]], starts[r], pages[r]) for r in live]
            logits.append(runner._forward_decode(items, {}))
        assert graphs.replays == [next(b for b in graphs.buckets if b >= len(live))]
        torch.testing.assert_close(logits[0], logits[1], atol=1e-4, rtol=1e-4)
        for r in live:
            starts[r] += 1


def test_verify_steps_replay_the_decode_graphs_a_row_per_token(runners):
    """A verify step's rows (each item's last token and its drafts) run through the graph of
    the bucket that holds them all, each row attending up to its own position, and give
    the logits of the portable layers' verify step; one over the largest bucket runs
    eagerly, and gives them too."""
    ours, ref = runners(GraphsOnCpu), runners(PlainCpu)
    graphs = ours.graphs
    prompts = {"a": [3, 1, 4, 1, 5, 9, 2], "b": [6, 5, 3], "c": [5, 8, 9, 7, 9, 3, 2, 3, 8]}
    pages = {"a": [60, 61, 62, 63], "b": [64, 65, 66], "c": [67, 68, 69, 70]}
    for runner in (ours, ref):
        items = [BatchItem(r, i, ids, 0, pages[r]) for i, (r, ids) in enumerate(prompts.items())]
        _logits(runner, False, items)
    starts = {r: len(ids) for r, ids in prompts.items()}
    steps = [  # (the drafts of each live request, the bucket its rows replay; None: eager)
        ({"a": [11, 12], "b": []}, 4),  # 3 + 1 rows
        ({"a": [13], "c": [14]}, 4),  # 2 + 2 rows
        ({"b": [15, 16]}, 4),  # 3 rows, padded
        ({"a": [17], "b": [18], "c": [19, 20]}, None),  # 7 rows: over the largest bucket
    ]
    for drafts, bucket in steps:
        graphs.replays.clear()
        logits = []
        for runner in (ours, ref):
            items = [
                BatchItem(r, ord(r), [40 + starts[r], *d], starts[r], pages[r], num_draft=len(d))
                for r, d in drafts.items()
            ]
            logits.append(runner._forward_decode(items, {}))
        assert graphs.replays == ([] if bucket is None else [bucket])
        rows = sum(1 + len(d) for d in drafts.values())
        assert logits[0].shape[0] == rows
        torch.testing.assert_close(logits[0], logits[1], atol=1e-4, rtol=1e-4)
        for r, d in drafts.items():
            starts[r] += 1 + len(d)  # every token verified is kept: positions move on


@pytest.mark.parametrize("platform", [TritonOnCpu, GraphsOnCpu], ids=["eager", "graphs"])
def test_future_rows_read_the_previous_launchs_tokens(runners, platform):
    """Overlap scheduling's input tokens: an item naming row r of the previous launch gets
    the token that launch left at `future_ids[r]`, in the eager path and in the graph."""
    runner = runners(platform)
    pages = {"a": [9, 2, 40], "b": [17, 5]}
    prompt = {"a": [1, 2, 3, 4, 5], "b": [8, 9, 10]}
    _logits(runner, False, [BatchItem(r, i, prompt[r], 0, pages[r]) for i, r in enumerate("ab")])
    real = [BatchItem("a", 0, [70], 5, pages["a"]), BatchItem("b", 1, [71], 3, pages["b"])]
    want = runner._forward_decode(real, {}).clone()
    runner.future_ids[:2] = torch.tensor([71, 70])  # the previous launch's rows: b, then a
    future = [
        BatchItem("a", 0, [0], 5, pages["a"], future_row=1),
        BatchItem("b", 1, [0], 3, pages["b"], future_row=0),
    ]
    torch.testing.assert_close(runner._forward_decode(future, {}), want, atol=1e-5, rtol=1e-5)


def test_a_failed_capture_stops_the_start_saying_what_to_change(checkpoint):
    class Failing(GraphsOnCpu):
        def make_graph_runner(self, model_runner):
            graphs = super().make_graph_runner(model_runner)

            def capture():
                raise MemoryError("no room for the graphs")

            graphs.capture = capture
            return graphs

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(runner_module, "get_current_platform", Failing)
        args = ServerArgs(dtype="float32", max_total_tokens=512, page_size=4, skip_warmup=True)
        with pytest.raises(RuntimeError, match="--disable-cuda-graph.*--cuda-graph-max-bs"):
            runner_module.ModelRunner(args, checkpoint)


def test_embeddings_of_a_decoder_through_the_triton_layers(runners):
    from cadence.model_executor.runner import EmbedItem

    items = [EmbedItem("e1", [1, 2, 3, 4, 5], pages=[50, 51]), EmbedItem("e2", [9, 8], pages=[52])]
    got = runners(TritonOnCpu).embed(items)
    want = runners(PlainCpu).embed(items)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-4, rtol=1e-4)
