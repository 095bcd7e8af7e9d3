"""The x86 levels the native library is built for, each its own shared object, and which one this CPU runs.

As llama.cpp's ``GGML_CPU_ALL_VARIANTS``: ``tokenpipe build-kernels`` (at install, and in the image's build
stage) compiles every level, whatever CPU builds them; a process loads the highest level its CPU lists
(:func:`level_for`, from :func:`~generator.kernels.cpu.cpu_info`'s flags). The C sources pick their vector
width and instructions from the compiler's macros (``csrc/simd.h``), so a level is just its flags.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AMX_FLAGS", "AVX512_FLAGS", "FLAGS", "LEVELS", "VNNI_FLAGS", "Level", "build_flags", "level_for",
           "level_named"]

FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-fPIC")  # every level's: the AVX2 build
# gemv.c's one-row int4 loop and attention's vectors on AVX-512, VNNI's fused multiply-adds with it (and
# gemm8's 16-feature blocks), then gemm8's AMX tiles.
AVX512_FLAGS = ("-mavx512f", "-mavx512bw")
VNNI_FLAGS = ("-mavx512vnni",)
AMX_FLAGS = ("-mamx-tile", "-mamx-int8")


@dataclass(frozen=True)
class Level:
    """One build of the library: its name (in the object's file name), compiler flags, and the
    ``/proc/cpuinfo`` flags a CPU must list to run it (beyond AVX2 and FMA, which every level needs)."""

    name: str
    flags: tuple[str, ...]
    needs: frozenset[str]

    def runs_on(self, cpu_flags: list[str] | None) -> bool:
        """Whether a CPU listing ``cpu_flags`` can run this build."""
        return self.needs <= set(cpu_flags or ())


# lowest first; each level's needs include the one's below it
LEVELS = (
    Level("avx2", FLAGS, frozenset()),
    Level("avx512", FLAGS + AVX512_FLAGS, frozenset({"avx512f", "avx512bw"})),
    Level("avx512vnni", FLAGS + AVX512_FLAGS + VNNI_FLAGS, frozenset({"avx512f", "avx512bw", "avx512_vnni"})),
    Level("amx", FLAGS + AVX512_FLAGS + VNNI_FLAGS + AMX_FLAGS,
          frozenset({"avx512f", "avx512bw", "avx512_vnni", "amx_tile", "amx_int8"})),
)


def level_for(cpu_flags: list[str] | None) -> Level:
    """The highest level a CPU listing ``cpu_flags`` runs (the AVX2 build where it lists no AVX-512;
    whether it has AVX2 at all is the loader's check)."""
    return [lvl for lvl in LEVELS if lvl.runs_on(cpu_flags)][-1]


def level_named(name: str) -> Level:
    """The level called ``name``; ValueError naming the levels where there is none."""
    for lvl in LEVELS:
        if lvl.name == name:
            return lvl
    raise ValueError(f"no kernel level {name!r} (levels: {', '.join(lvl.name for lvl in LEVELS)})")


def build_flags(cpu_flags: list[str] | None) -> tuple[str, ...]:
    """The compiler flags of the level a CPU listing ``cpu_flags`` runs."""
    return level_for(cpu_flags).flags
