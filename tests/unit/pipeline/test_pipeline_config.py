"""Pipeline declarations: YAML and Python say the same thing; every mistake is caught at load
with an error that names the stage and says what to change."""

from __future__ import annotations

import textwrap

import pytest
from pipeline_executors import Step, concat

from cadence.pipeline import PipelineConfig, RelayConfig, StageConfig, load_pipeline_config
from cadence.pipeline.config import FRONT

E = "pipeline_executors:"

FAN_YAML = """
name: fan
relay: {backend: torch, slot_mb: 4, credits: 2, inline_max_bytes: 0}
stages:
  - {name: a, executor: "pipeline_executors:Step", args: {add: 1}, next: [b, c]}
  - {name: b, executor: "pipeline_executors:Step", next: d, colocate_with: [a]}
  - {name: c, executor: "pipeline_executors:Step", next: d, device: cpu}
  - name: d
    executor: "pipeline_executors:Step"
    merge: "pipeline_executors:concat"
    terminal: true
    stream_to_client: true
"""


def _yaml(tmp_path, text: str):
    path = tmp_path / "pipeline.yaml"
    path.write_text(textwrap.dedent(text))
    return str(path)


def _stages(*stages: StageConfig, **kwargs) -> PipelineConfig:
    return PipelineConfig(stages=stages, **kwargs)


def test_yaml_and_python_declare_the_same_pipeline(tmp_path):
    from_yaml = load_pipeline_config(_yaml(tmp_path, FAN_YAML))
    from_python = PipelineConfig(
        name="fan",
        relay=RelayConfig(backend="torch", slot_mb=4, credits=2, inline_max_bytes=0),
        stages=[
            StageConfig(name="a", executor=Step, args={"add": 1}, next=["b", "c"]),
            StageConfig(name="b", executor=Step, next="d", colocate_with=["a"]),
            StageConfig(name="c", executor=E + "Step", next="d"),
            StageConfig(
                name="d",
                executor=Step,
                merge=concat,
                terminal=True,
                stream_to_client=True,
            ),
        ],
    )
    assert from_yaml == from_python
    assert PipelineConfig.from_dict(from_python.to_dict()) == from_python
    graph = from_yaml.graph
    assert graph.entry == "a" and graph.terminals == ("d",)
    assert graph.data_inputs["d"] == ("b", "c")
    assert graph.processes == ("a+b", "c", "d") and graph.rank_of("c") == 1
    assert graph.colocated("a", "b") and not graph.colocated("a", "c")
    assert graph.client_streams == ("d",)
    assert from_yaml.relay.slot_bytes == 4 << 20


def test_stream_edges_and_an_explicit_entry():
    config = _stages(
        StageConfig(name="talk", executor=Step, stream_to="voc"),
        StageConfig(name="voc", executor=Step, terminal=True),
        entry="talk",
    )
    assert config.graph.stream_input == {"voc": "talk"}
    assert config.graph.data_inputs["voc"] == ()


def test_stages_placed_in_the_front_have_no_process_of_their_own(tmp_path):
    text = """
    stages:
      - {name: llm, executor: "pipeline_executors:Step", placement: front, stream_to: [talk]}
      - {name: talk, executor: "pipeline_executors:Step", stream_to: [voc]}
      - {name: voc, executor: "pipeline_executors:Step", colocate_with: [talk], next: out}
      - {name: out, executor: "pipeline_executors:Step", placement: front, terminal: true}
    """
    config = load_pipeline_config(_yaml(tmp_path, text))
    graph = config.graph
    assert graph.front_stages == ("llm", "out") and graph.processes == ("talk+voc",)
    assert graph.process_of["llm"] == graph.process_of["out"] == FRONT
    assert graph.colocated("llm", "out") and not graph.colocated("llm", "talk")
    assert graph.rank_of("talk+voc") == 0  # the front takes no rank in a relay group
    assert PipelineConfig.from_dict(config.to_dict()) == config
    assert StageConfig(name="x", executor=Step).placement == "process"


@pytest.mark.parametrize(
    "stages, message",
    [
        (
            [{"name": "a", "terminal": True, "placement": "server"}],
            "stage 'a': placement must be one of process, front, got 'server'",
        ),
        (
            [
                {"name": "a", "next": "b"},
                {"name": "b", "terminal": True, "placement": "front", "colocate_with": ["a"]},
            ],
            "stage 'b': placement front runs the stage in the front process",
        ),
        (
            [
                {"name": "a", "next": "b", "placement": "front"},
                {"name": "b", "terminal": True, "colocate_with": ["a"]},
            ],
            "stage 'b': colocate_with names 'a', which is placed in the front",
        ),
    ],
)
def test_placement_mistakes_name_the_stage(stages, message):
    with pytest.raises(ValueError, match=message):
        PipelineConfig(stages=[StageConfig(executor=Step, **s) for s in stages])


@pytest.mark.parametrize(
    "stages, message",
    [
        (
            [
                StageConfig(name="a", executor=Step, next="zz"),
                StageConfig(name="b", executor=Step, terminal=True),
            ],
            "stage 'a': next names unknown stage 'zz'",
        ),
        (
            [StageConfig(name="a", executor=Step, terminal=True, colocate_with=["ghost"])],
            "stage 'a': colocate_with names unknown stage 'ghost'",
        ),
        (
            [
                StageConfig(name="a", executor=Step, next="b"),
                StageConfig(name="b", executor=Step, next="c"),
                StageConfig(name="c", executor=Step, next="b", terminal=True),
            ],
            "cycle: b -> c -> b",
        ),
        (
            [
                StageConfig(name="a", executor=Step, next=["b", "c"]),
                StageConfig(name="b", executor=Step, next="d"),
                StageConfig(name="c", executor=Step, next="d"),
                StageConfig(name="d", executor=Step, terminal=True),
            ],
            "stage 'd' receives from 2 stages \\(b, c\\) but has no merge function",
        ),
        (
            [
                StageConfig(name="a", executor=Step, terminal=True),
                StageConfig(name="b", executor=Step, terminal=True),
            ],
            "cannot tell the entry stage: 2 stages",
        ),
        (
            [StageConfig(name="a", executor=Step, next="b"), StageConfig(name="b", executor=Step)],
            "stage 'b' sends its result nowhere",
        ),
        (
            [StageConfig(name="a", executor=Step, next="a", terminal=True)],
            "stage 'a': next names the stage itself",
        ),
        (
            [StageConfig(name="a", executor=Step, stream_to="b")],
            "stage 'a': stream_to names unknown stage 'b'",
        ),
        (
            [
                StageConfig(name="a", executor=Step, next="b"),
                StageConfig(name="b", executor=Step, next="a"),
            ],
            "cycle",
        ),
        (
            [
                StageConfig(name="a", executor=Step, next="b"),
                StageConfig(name="b", executor=Step, stream_to="a"),
            ],
            "cycle",
        ),
        (
            [StageConfig(name="a", executor=Step, stream_to_client=True)],
            "no stage is terminal",
        ),
        (
            [
                StageConfig(name="a", executor=Step, stream_to="c", next="b"),
                StageConfig(name="b", executor=Step, stream_to="c"),
                StageConfig(name="c", executor=Step, terminal=True),
            ],
            "stage 'c' has two stream inputs",
        ),
        (
            [
                StageConfig(name="a", executor=Step, terminal=True),
                StageConfig(name="a", executor=Step, terminal=True),
            ],
            "stage 'a' is declared twice",
        ),
    ],
)
def test_graph_mistakes_name_the_stage(stages, message):
    with pytest.raises(ValueError, match=message):
        PipelineConfig(stages=stages)


def test_a_terminal_no_path_reaches(tmp_path):
    text = """
    entry: a
    stages:
      - {name: a, executor: "m:A", terminal: true}
      - {name: lost, executor: "m:B", next: island}
      - {name: island, executor: "m:B", terminal: true}
    """
    with pytest.raises(
        ValueError, match="terminal 'island' is not reached by any path from the entry stage 'a'"
    ):
        load_pipeline_config(_yaml(tmp_path, text))


@pytest.mark.parametrize(
    "text, message",
    [
        ("stages: []", "non-empty `stages` list"),
        (
            "stages: [{name: a, executor: 'm:A', terminal: true, nxt: b}]",
            "stage 'a': unknown key\\(s\\) nxt",
        ),
        ("stages: [{name: a, terminal: true}]", "stage 'a': .*executor"),
        (
            "stages: [{name: a, executor: 'no_colon', terminal: true}]",
            "must be 'package.module:attr'",
        ),
        ("stages: [{name: 'a b', executor: 'm:A', terminal: true}]", "stage name 'a b'"),
        ("stages: [{name: client, executor: 'm:A', terminal: true}]", "reserved"),
        ("stages: [{name: a, executor: 'm:A', terminal: 'yes'}]", "terminal must be true or false"),
        (
            "relay: {credits: 0}\nstages: [{name: a, executor: 'm:A', terminal: true}]",
            "relay.credits must be",
        ),
        (
            "relay: {slot_mb: -1}\nstages: [{name: a, executor: 'm:A', terminal: true}]",
            "relay.slot_mb",
        ),
        (
            "relay: {speed: 1}\nstages: [{name: a, executor: 'm:A', terminal: true}]",
            "relay: unknown key",
        ),
        (
            "stages: [{name: a, executor: 'm:A', terminal: true}]\nextra: 1",
            "the pipeline: unknown key",
        ),
        (
            "stages: [{name: a, executor: 'm:A', terminal: true, args: [1]}]",
            "args must be a mapping",
        ),
        ("- just a list", "a mapping with a `stages` list"),
        ("stages: [{name: a: b}]", "not valid YAML"),
    ],
)
def test_yaml_mistakes_say_what_to_fix(tmp_path, text, message):
    path = _yaml(tmp_path, text)
    with pytest.raises(ValueError, match=message) as e:
        load_pipeline_config(path)
    assert str(e.value).startswith(path)


def test_a_missing_file_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="cannot read the pipeline declaration"):
        load_pipeline_config(str(tmp_path / "nope.yaml"))


def test_python_factories_must_be_importable_by_name():
    def local_factory():
        return None

    with pytest.raises(ValueError, match="top of an importable module"):
        StageConfig(name="a", executor=local_factory, terminal=True)
    with pytest.raises(ValueError, match="top of an importable module"):
        StageConfig(name="a", executor=lambda: None, terminal=True)
    assert StageConfig(name="a", executor=Step, terminal=True).executor == E + "Step"
