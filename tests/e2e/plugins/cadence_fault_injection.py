"""A test plugin that makes one chosen request fail inside the server, as a buggy plugin or
an unforeseen input would.

A request opts in with a marker among its stop strings (a stop string the model never
writes): the sampler raises for a batch holding a request marked SAMPLE_MARKER, the
detokenizer for a request marked DETOKENIZE_MARKER. Every other request is untouched, so
the tests see whether a failure stays with the request that caused it.
"""

from cadence.plugins import HookType, plugin_hook

SAMPLE_MARKER = "<<inject-fault:sample>>"
DETOKENIZE_MARKER = "<<inject-fault:detokenize>>"


def register() -> None:
    @plugin_hook("cadence.layers.sampler.sample", type=HookType.AROUND)
    def failing_sample(original, logits, rows, *args, **kwargs):
        if any(SAMPLE_MARKER in (row.params.stop or ()) for row in rows):
            raise RuntimeError("injected sampling fault")
        return original(logits, rows, *args, **kwargs)

    @plugin_hook("cadence.detokenizer.detokenizer.Detokenizer._process_one", type=HookType.AROUND)
    def failing_detokenize(original, self, batch, i, rid, *args, **kwargs):
        if DETOKENIZE_MARKER in (batch.stop_strs[i] or ()):
            raise RuntimeError("injected detokenizer fault")
        return original(self, batch, i, rid, *args, **kwargs)
