"""Byte accounting for the benchmarked operations: unique bytes per op and per request.

"Unique bytes" are the bytes an operation must move between DRAM and the chip at least
once: every input it reads and every output it writes, each counted once, however many
times a kernel touches it. Achieved bandwidth is unique bytes / time, so a kernel that
re-reads data (or spills) shows as lower GB/s, never as more bytes.

Per request and head, with ``T = S + 1`` tokens, head dims ``K`` and ``V``, activation
bytes ``b`` and an FP32 state of ``V*K*4`` bytes:

* token I/O: reads ``T*(3K + V + 1)*b`` (q, k, raw_g, v, raw_beta), writes ``T*V*b`` (o);
* record of one token: ``V*4`` (FP32 correction) + ``2K*b`` (raw k, raw g);
* full-state verify: reads 1 state, writes ``T`` states, plus token I/O;
* recovery verify: reads 1 state, writes ``T`` records, plus token I/O;
* commit of ``n`` tokens: reads 1 state and ``n`` records, writes 1 state;
* fused verify (the previous step's ``n`` accepted records committed inside this step's
  verify): reads 1 state and ``n`` records, writes 1 state and ``T`` records, plus token I/O.

Per layer each op also reads the gate parameters (``A_log`` [H] and ``dt_bias`` [H, K],
FP32) once, and each launch reads its int32 index vectors. A stack of ``L`` layers is
``L`` times the per-layer bytes (verify runs one launch per layer; the commit runs one
launch for all layers, so its index vectors count once). Verify + commit in one graph
counts both ops' bytes: at serving batch sizes the commit re-reads the checkpoint and the
records from DRAM after verify, so their sum is the traffic.
"""

from __future__ import annotations

from dataclasses import dataclass

INDEX_BYTES = 4  # int32 state indices, lengths and query_start_loc
PARAM_BYTES = 4  # FP32 A_log and dt_bias


@dataclass(frozen=True)
class OpShape:
    """The sizes that set an op's traffic: heads, head dims, S and element widths."""

    heads: int
    k: int
    v: int
    num_spec: int
    act_bytes: int
    state_bytes: int = 4

    @property
    def tokens(self) -> int:
        """Tokens per request per step, ``S + 1``."""
        return self.num_spec + 1

    @property
    def state_per_head(self) -> int:
        """Bytes of one head's recurrent state."""
        return self.v * self.k * self.state_bytes

    @property
    def record_per_token(self) -> int:
        """Bytes of one token's record per head: FP32 correction plus raw k and raw g."""
        return self.v * 4 + 2 * self.k * self.act_bytes

    @property
    def io_per_token(self) -> int:
        """Activation bytes per token and head: q, k, raw_g, v, raw_beta read, o written."""
        return (3 * self.k + self.v + 1) * self.act_bytes + self.v * self.act_bytes

    @property
    def params_per_layer(self) -> int:
        """Gate parameter bytes of one layer: ``A_log`` [H] and ``dt_bias`` [H, K]."""
        return self.heads * (1 + self.k) * PARAM_BYTES


def full_verify_bytes(shape: OpShape, batch: int, layers: int = 1) -> int:
    """Full-state verify: 1 state read and ``T`` written per request and head."""
    T = shape.tokens
    per_head = (1 + T) * shape.state_per_head + T * shape.io_per_token
    # state_indices [B, T], num_accepted [B], query_start_loc [B+1]
    index = (batch * T + batch + batch + 1) * INDEX_BYTES
    return layers * (batch * shape.heads * per_head + shape.params_per_layer + index)


def recovery_verify_bytes(shape: OpShape, batch: int, layers: int = 1) -> int:
    """Recovery verify: 1 state read and ``T`` records written per request and head."""
    T = shape.tokens
    per_head = shape.state_per_head + T * (shape.io_per_token + shape.record_per_token)
    # state_indices [B], query_start_loc [B+1]
    index = (batch + batch + 1) * INDEX_BYTES
    return layers * (batch * shape.heads * per_head + shape.params_per_layer + index)


def commit_bytes(shape: OpShape, batch: int, accepted: int, layers: int = 1) -> int:
    """Commit of ``accepted`` tokens: 1 state read, ``accepted`` records read, 1 state written."""
    if not 0 <= accepted <= shape.tokens:
        raise ValueError(
            f"argument 'accepted': expected 0..{shape.tokens} (S+1), got {accepted}"
        )
    per_head = 2 * shape.state_per_head + accepted * shape.record_per_token
    if accepted == 0:
        per_head = 0  # nothing to replay: an in-place commit touches no state
    # state_indices [B], commit_lens [B]: one launch for every layer
    index = 2 * batch * INDEX_BYTES
    return layers * (batch * shape.heads * per_head + shape.params_per_layer) + index


def fused_verify_bytes(shape: OpShape, batch: int, accepted: int, layers: int = 1) -> int:
    """Fused verify after ``accepted`` pending tokens: the commit's state traffic (1 read,
    1 write) and ``accepted`` records read, plus the recovery verify's records and I/O."""
    if not 0 <= accepted <= shape.tokens:
        raise ValueError(
            f"argument 'accepted': expected 0..{shape.tokens} (S+1), got {accepted}"
        )
    T = shape.tokens
    per_head = shape.state_per_head * (2 if accepted else 1)
    per_head += T * (shape.io_per_token + shape.record_per_token)
    per_head += accepted * shape.record_per_token
    # state_indices [B], query_start_loc [B+1], prev_lens [B]
    index = (3 * batch + 1) * INDEX_BYTES
    return layers * (batch * shape.heads * per_head + shape.params_per_layer + index)


def full_state_bytes_per_request(shape: OpShape, layers: int = 1) -> int:
    """State a full-state request holds: ``S + 1`` states per layer."""
    return layers * shape.tokens * shape.heads * shape.state_per_head


def recovery_state_bytes_per_request(shape: OpShape, layers: int = 1) -> int:
    """State a recovery request holds: 1 checkpoint plus one scratch row of records per layer."""
    records = shape.heads * shape.tokens * shape.record_per_token
    return layers * (shape.heads * shape.state_per_head + records)


def gbps(num_bytes: int, ms: float) -> float:
    """Achieved bandwidth in GB/s (10^9 bytes per second)."""
    return num_bytes / (ms * 1e-3) / 1e9 if ms > 0 else float("nan")
