"""The GPUs `logitless bench compile` compiles the Triton kernels for, and what a compiled kernel's resources leave of
each: how many warps stay resident on one multiprocessor (occupancy) and whether its shared memory fits.

NVIDIA's numbers are the CUDA Programming Guide's per compute capability (resident warps and blocks per SM, 64K
32-bit registers per SM, at most 255 per thread, allocated 256 per warp; shared memory per SM and per block, 1 KiB
of it reserved per block, allocated in 128-byte units), and occupancy is computed as CUDA's occupancy calculator
does: blocks of ``warps`` warps, as many as the registers, the shared memory, the resident warps and the resident
blocks each allow. AMD's CDNA3 (gfx942) numbers are the AMDGPU LLVM backend's: a CU of 4 SIMDs, each holding at most
8 waves of 64 lanes and 512 VGPRs per lane, allocated 8 at a time, an SGPR count over 100 allowing 7 waves, at most
16 workgroups of several waves, and 64 KiB of LDS per CU.
"""

from __future__ import annotations

from dataclasses import dataclass

KIB = 1024


@dataclass(frozen=True)
class Target:
    name: str  # as the tables name it: "sm_90", "gfx942"
    backend: str  # Triton's: "cuda" or "hip"
    arch: int | str  # Triton's GPUTarget arch: compute capability as an int, or the gfx name
    warp_size: int
    chips: str  # the GPUs it is, for the tables
    max_warps: int  # resident warps (waves) per SM (CU)
    max_blocks: int  # resident blocks (workgroups) per SM (CU)
    shared_per_sm: int  # bytes of shared memory (LDS) per SM (CU)
    shared_per_block: int  # bytes one block may have at most

    def occupancy(self, registers: int, shared: int, warps: int, scalar_registers: int = 0) -> int:
        """Resident warps (waves) per SM (CU) of a kernel of ``warps`` warps per block using ``registers`` registers
        per thread (AMD: VGPRs; ``scalar_registers`` its SGPRs) and ``shared`` bytes of shared memory per block;
        0 when a block cannot be resident at all."""
        if shared > self.shared_per_block:
            return 0
        if self.backend == "hip":
            blocks = _cdna3_blocks(registers, scalar_registers, shared, warps, self)
        else:
            blocks = _cuda_blocks(registers, shared, warps, self)
        return min(blocks, self.max_blocks, self.max_warps // warps) * warps


def _round_up(value: int, unit: int) -> int:
    return -(-value // unit) * unit


CUDA_REGISTERS_PER_SM = 64 * KIB
CUDA_MAX_REGISTERS_PER_THREAD = 255
CUDA_REGISTER_UNIT = 256  # registers are allocated to a warp 256 at a time
CUDA_RESERVED_SHARED = 1 * KIB  # per block, since sm_80
CUDA_SHARED_UNIT = 128


def _cuda_blocks(registers: int, shared: int, warps: int, target: Target) -> int:
    if registers > CUDA_MAX_REGISTERS_PER_THREAD:
        return 0
    per_warp = _round_up(max(registers, 1) * target.warp_size, CUDA_REGISTER_UNIT)
    by_registers = CUDA_REGISTERS_PER_SM // per_warp // warps
    by_shared = target.shared_per_sm // _round_up(shared + CUDA_RESERVED_SHARED, CUDA_SHARED_UNIT)
    return min(by_registers, by_shared)


CDNA3_SIMDS = 4  # per CU
CDNA3_VGPRS = 512  # per lane of a SIMD, VGPRs and AGPRs together
CDNA3_VGPR_UNIT = 8
CDNA3_WAVES_PER_SIMD = 8


def _cdna3_blocks(vgprs: int, sgprs: int, lds: int, warps: int, target: Target) -> int:
    by_vgprs = CDNA3_VGPRS // _round_up(max(vgprs, 1), CDNA3_VGPR_UNIT)
    by_sgprs = 7 if sgprs > 100 else CDNA3_WAVES_PER_SIMD
    waves = CDNA3_SIMDS * min(CDNA3_WAVES_PER_SIMD, by_vgprs, by_sgprs)
    by_lds = target.shared_per_sm // lds if lds else target.max_blocks
    return min(waves // warps, by_lds)


TARGETS = {target.name: target for target in (
    Target("sm_80", "cuda", 80, 32, "A100", 64, 32, 164 * KIB, 163 * KIB),
    Target("sm_90", "cuda", 90, 32, "H100, H200", 64, 32, 228 * KIB, 227 * KIB),
    Target("sm_100", "cuda", 100, 32, "B200, GB200", 64, 32, 228 * KIB, 227 * KIB),
    Target("sm_120", "cuda", 120, 32, "RTX 50 series, RTX PRO 6000", 48, 32, 100 * KIB, 99 * KIB),
    Target("gfx942", "hip", "gfx942", 64, "MI300X, MI300A, MI325X", 32, 16, 64 * KIB, 64 * KIB),
)}
