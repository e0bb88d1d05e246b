"""Tensor and pipeline parallelism over torch.distributed: who each rank is (`layout`), its
groups and collectives (`group`). The model code asks `RankGroups` for what crosses ranks;
the model runner makes the groups; the leader's orders reach the followers through them."""
