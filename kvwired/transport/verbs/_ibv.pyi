"""Types of the compiled verbs core (kvwired/transport/verbs/_ibv.c)."""

from collections.abc import Sequence

IBV_ACCESS_LOCAL_WRITE: int
IBV_ACCESS_REMOTE_WRITE: int
IBV_ACCESS_MW_BIND: int
IBV_PORT_ACTIVE: int
IBV_QPS_RESET: int
IBV_QPS_INIT: int
IBV_QPS_RTR: int
IBV_QPS_RTS: int
IBV_QPS_ERR: int
IBV_WC_SUCCESS: int
IBV_WC_RETRY_EXC_ERR: int
IBV_WC_RNR_RETRY_EXC_ERR: int
IBV_WC_REM_ACCESS_ERR: int
IBV_WC_REM_OP_ERR: int
IBV_WC_REM_INV_REQ_ERR: int
IBV_WC_LOC_PROT_ERR: int
IBV_WC_LOC_LEN_ERR: int
IBV_WC_LOC_QP_OP_ERR: int
IBV_WC_WR_FLUSH_ERR: int
IBV_WC_GENERAL_ERR: int
IBV_WC_RECV_RDMA_WITH_IMM: int
IBV_WC_BIND_MW: int
IBV_WC_LOCAL_INV: int
IBV_WC_RDMA_WRITE: int
IBV_MTU_256: int
IBV_MTU_512: int
IBV_MTU_1024: int
IBV_MTU_2048: int
IBV_MTU_4096: int

# (wr_id, status, opcode, immediate in host order)
Completion = tuple[int, int, int, int]

class VerbsError(OSError): ...

def wc_status_str(status: int) -> str: ...

class _Resource:
    @property
    def closed(self) -> bool: ...
    def close(self) -> None: ...

class Context(_Resource):
    def __init__(self, name: str) -> None: ...
    def query_port(self, port: int) -> tuple[int, int, int]: ...

class ProtectionDomain(_Resource):
    def __init__(self, context: Context) -> None: ...

class MemoryRegion(_Resource):
    lkey: int
    rkey: int
    address: int
    length: int
    def __init__(self, pd: ProtectionDomain, address: int, length: int,
                 access: int) -> None: ...

class MemoryWindow(_Resource):
    @property
    def rkey(self) -> int: ...
    def __init__(self, pd: ProtectionDomain) -> None: ...

class CompletionQueue(_Resource):
    @property
    def fd(self) -> int: ...
    def __init__(self, context: Context, depth: int) -> None: ...
    def poll(self, limit: int = ...) -> list[Completion]: ...
    def woken(self) -> list[Completion] | None: ...

class QueuePair(_Resource):
    qp_num: int
    def __init__(self, pd: ProtectionDomain, cq: CompletionQueue, send_depth: int,
                 recv_depth: int) -> None: ...
    def to_init(self, port: int, access: int) -> None: ...
    def to_rtr(self, port: int, path_mtu: int, dest_qp_num: int, rq_psn: int, dgid: bytes,
               sgid_index: int, min_rnr_timer: int) -> None: ...
    def to_rts(self, sq_psn: int, timeout: int, retry_cnt: int, rnr_retry: int) -> None: ...
    def state(self) -> int: ...
    def post_writes(self, writes: Sequence[tuple[int, int, int]], start: int, end: int,
                    local_base: int, lkey: int, remote_base: int, rkey: int,
                    imm: int | None, signalled: dict[int, int]) -> None: ...
    def post_receives(self, address: int, length: int, lkey: int, count: int) -> None: ...
    def bind_window(self, window: MemoryWindow, key: int, mr: MemoryRegion, address: int,
                    length: int, access: int, wr_id: int) -> None: ...
    def invalidate(self, key: int, wr_id: int) -> None: ...
