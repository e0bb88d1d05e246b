"""The model runner: one scheduled batch in, a forward pass, sampled tokens and logprobs out."""
