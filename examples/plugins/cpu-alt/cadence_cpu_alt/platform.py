"""`CpuAltPlatform`: Cadence's CPU platform with a vendor's own name, device name and
defaults. It inherits the host's device operations (`DeviceMixin`) and the portable
factories from `CpuPlatform`. A vendor of a new device subclasses
`cadence.platforms.SRTPlatform` instead and implements both for its device; the table in
docs/plugins.md says which methods the engine calls today."""

from __future__ import annotations

from cadence.platforms.cpu import CpuPlatform
from cadence.server_args import ServerArgs


class CpuAltPlatform(CpuPlatform):
    name = "cpu-alt"

    def get_device_name(self) -> str:
        return f"{super().get_device_name()} (cadence-cpu-alt)"

    def apply_server_args_defaults(self, args: ServerArgs) -> ServerArgs:
        # This "device" prefers 32-token KV pages; a page size the user chose is left alone.
        if args.page_size == ServerArgs.page_size:
            return args.replace(page_size=32)
        return args

    def make_attention_backend(self, kv_pool, num_heads, num_kv_heads, head_dim):
        # A vendor returns its own cadence.layers.attention.AttentionBackend subclass here.
        return super().make_attention_backend(kv_pool, num_heads, num_kv_heads, head_dim)
