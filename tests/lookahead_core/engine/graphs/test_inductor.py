"""A package's build key holds the instruction set inductor's kernels use: two hosts that differ
in any part of it (inductor's vector ISA, AMX tiles, a cpuinfo flag -march=native turns on) never
share a package."""
from lookahead_core.engine.graphs import inductor
from lookahead_core.engine.graphs.inductor import build_key, isa_description
from lookahead_core.engine.graphs.package_store import digest

HOST = {"capability": "AVX512", "machine": "x86_64", "vec_isa": "avx512", "amx_tiles": False,
        "flags": ["avx512f", "avx512bw", "fpu", "ht"]}
OTHERS = [{"vec_isa": "avx512 avx512_vnni amx_tile"}, {"amx_tiles": True},
          {"flags": [*HOST["flags"], "avx512_bf16"]}, {"flags": [*HOST["flags"], "avx512_fp16"]},
          {"flags": [*HOST["flags"], "amx_tile"]}, {"vec_isa": "avx2"}]


def test_hosts_that_differ_in_the_instructions_inductor_targets_get_different_builds(monkeypatch):
    described = [isa_description(**{**HOST, **other}) for other in [{}, *OTHERS]]
    assert len(set(described)) == len(described)
    assert isa_description(**{**HOST, "flags": [*HOST["flags"], "tsc"]}) == described[0]  # not an ISA flag
    builds = set()
    for isa in described:
        monkeypatch.setattr(inductor, "instruction_set", lambda isa=isa: isa)
        builds.add(digest(build_key("source"), 4))
    assert len(builds) == len(described)


def test_this_hosts_instruction_set_holds_inductors_pick():
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    assert inductor._vec_isa() == str(pick_vec_isa())
    assert inductor.instruction_set().startswith(inductor.torch.backends.cpu.get_cpu_capability())
