"""Pipelines shipped with Cadence: `<name>.yaml` here is served by `cadence serve --pipeline
<name>` (see `cadence.pipeline.config.resolve_pipeline_path`)."""
