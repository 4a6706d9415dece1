"""Delta weight sync over any channel: each bucket travels as a frame (a 4-int header, then its payload bytes).

The sender (actor rank 0) and every engine worker keep a copy of each bucket as the engines last loaded
it, in the engines' dtype and in host memory. The sender encodes the new bucket against its copy
(`delta.DeltaEncoder`), sends the frame, and takes the new bucket as its copy; the receiver applies the
frame to its copy and loads the whole bucket into the model. Both copies are emptied when a channel
opens (engines joined or restarted, a resumed run), so the first sync of a channel is full. Frames use
the channel's own staging/send/recv with indexes 2i (header) and 2i+1 (payload), so every transport
carries them unchanged; an empty payload is not sent.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from rlhf_trainer.weight_sync import delta
from rlhf_trainer.weight_sync.bucketing import Bucket, ParamSlot, dtype_from_name
from rlhf_trainer.weight_sync.channels import WeightChannel

CODES: dict[delta.Encoding, int] = {"full": 0, "gaps": 1, "bitmask": 2}
ENCODINGS = {v: k for k, v in CODES.items()}
HEADER = Bucket("int64", [ParamSlot("header", (4,), 0)])


def _payload_bucket(nbytes: int) -> Bucket:
    return Bucket("uint8", [ParamSlot("payload", (nbytes,), 0)])


def _as_bytes(t: torch.Tensor | None) -> torch.Tensor:
    if t is None or t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    return t.contiguous().view(torch.uint8).reshape(-1)


def send_frame(channel: WeightChannel, d: delta.Delta, index: int) -> int:
    """Header [encoding, numel, values, extra bytes] then payload (values' bytes, then gaps or bitmask).
    Returns the bytes sent."""
    values = _as_bytes(d.values)
    extra = _as_bytes(d.gaps if d.gaps is not None else d.bitmask)
    header = channel.staging(HEADER, 2 * index)
    header.copy_(torch.tensor([CODES[d.encoding], d.numel, d.values.numel(), extra.numel()]))
    channel.send(header, 2 * index)
    n = values.numel() + extra.numel()
    if n:
        payload = channel.staging(_payload_bucket(n), 2 * index + 1)
        payload[: values.numel()].copy_(values)
        payload[values.numel() :].copy_(extra)
        channel.send(payload, 2 * index + 1)
    return 32 + n


def recv_frame(channel: WeightChannel, bucket: Bucket, index: int) -> tuple[delta.Delta, int]:
    """The next frame as a Delta whose tensors are host copies (the channel's memory is handed back at
    once), and the bytes that arrived."""
    code, numel, n_values, n_extra = (int(x) for x in channel.recv(HEADER, 2 * index).tolist())
    channel.done_with(2 * index)
    if numel != bucket.numel:
        raise RuntimeError(f"delta weight sync: bucket {index} holds {bucket.numel} elements, frame {numel}")
    dtype = dtype_from_name(bucket.dtype)
    width = torch.empty((), dtype=dtype).element_size()
    n = n_values * width + n_extra
    payload = torch.empty(0, dtype=torch.uint8)
    if n:
        payload = channel.recv(_payload_bucket(n), 2 * index + 1).to("cpu", copy=True)
        channel.done_with(2 * index + 1)
    values = payload[: n_values * width].view(dtype)
    extra = payload[n_values * width :]
    encoding = ENCODINGS[code]
    out = delta.Delta(encoding, numel, values)
    if encoding == "gaps":
        out.gaps = extra.view(delta.GAP_DTYPE)
    elif encoding == "bitmask":
        out.bitmask = extra
    return out, 32 + n


@dataclass
class DeltaSender:
    """Actor rank 0's side: its copy of every bucket as the engines hold it, and the encoder's skips."""

    encoder: delta.DeltaEncoder
    held: dict[int, torch.Tensor] = field(default_factory=dict)

    def reset(self) -> None:
        """A new channel: the engines hold nothing we sent."""
        self.held.clear()
        self.encoder.reset()

    def send(self, channel: WeightChannel, index: int, new: torch.Tensor) -> tuple[delta.Delta, int]:
        """Encode `new` (the packed bucket, host memory) against the copy, send it, keep it as the copy."""
        old = self.held.get(index)
        if old is not None and (old.numel() != new.numel() or old.dtype != new.dtype):
            old = None  # the plan changed shape: send whole
        d = self.encoder.encode(index, new, old)
        t0 = time.perf_counter()
        sent = send_frame(channel, d, index)
        if d.encoding == "full":  # the link's speed, which prices the next deltas (choose: time)
            self.encoder.observe_link(sent, time.perf_counter() - t0)
        if old is None:
            self.held[index] = new.clone()
        elif d.encoding == "full" or d.changed != 0:
            old.copy_(new)
        return d, sent


@dataclass
class DeltaReceiver:
    """An engine worker's side: its copy of every bucket, which the model was loaded from."""

    held: dict[int, torch.Tensor] = field(default_factory=dict)

    def reset(self) -> None:
        self.held.clear()

    def receive(
        self, channel: WeightChannel, bucket: Bucket, index: int, *, drop: bool = False
    ) -> tuple[torch.Tensor, delta.Delta, int]:
        """The bucket after the next frame (the copy itself), the frame and its bytes. `drop` (fault
        injection) discards a delta frame as if it had been lost: the copy stays as it was."""
        d, nbytes = recv_frame(channel, bucket, index)
        held = self.held.get(index)
        if d.encoding == "full":
            if held is None or held.numel() != d.numel or held.dtype != d.values.dtype:
                self.held[index] = held = d.values  # recv_frame's own host copy
            else:
                held.copy_(d.values)
            return held, d, nbytes
        if held is None:
            raise RuntimeError(
                f"delta weight sync: a {d.encoding} delta for bucket {index}, which this engine does not hold"
            )
        if not drop:
            delta.apply(d, held)
        return held, d, nbytes
