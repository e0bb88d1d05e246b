"""The detokenizer process: incremental decoding of token ids into text deltas, stop-string
trimming, and routing of each output to the front process that owns its request."""
