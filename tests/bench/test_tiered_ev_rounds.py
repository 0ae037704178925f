"""bench_tiered `ev`'s verdict on the training target: the median of the rounds' own ratios (each round's
all-DRAM child against its tiered child, run back to back), by CPU and by wall, with each child's
user / system split and the kernel's memory-management counters over its training steps, so a round
slowed by the kernel shows as such. No timing thresholds: figures are given, not measured."""
import pytest

from bench.harness.vmstat import EVENTS, GAUGES, vmstat, vmstat_delta
from bench.tiered.bench_tiered_ev import _print_rounds, _train_line


def _side(cpu, wall, sys_=0.1):
    return dict(train_cpu_us_per_key=cpu, train_wall_us_per_key=wall, train_user_us_per_key=cpu - sys_,
                train_sys_us_per_key=sys_, train_vm=dict(compact_stall=3, pgscan_direct=0, nr_dirty_start=10,
                                                        nr_dirty_end=20))


def test_the_verdict_is_the_median_of_each_rounds_own_ratio_by_cpu_and_by_wall(capsys):
    rounds = [(_side(1.0, 1.0), _side(2.0, 1.25)), (_side(1.2, 1.0), _side(1.5, 1.0)),
              (_side(0.9, 2.0), _side(1.0, 4.0))]
    by_cpu, by_wall = _print_rounds(rounds)
    assert by_cpu == pytest.approx([0.5, 0.8, 0.9]) and by_wall == pytest.approx([0.8, 1.0, 0.5])
    out = capsys.readouterr().out
    assert "median of 3 round(s): **0.80x by CPU**, 0.80x by wall" in out


def test_a_childs_training_line_splits_user_and_system_time_and_names_the_kernels_work():
    line = _train_line("tiered", _side(2.0, 2.5, sys_=0.6))
    assert "2.000 us CPU a key (1.400 user + 0.600 sys)" in line and "2.500 us wall" in line
    assert "compact_stall 3" in line and "dirty pages 10 -> 20" in line


def test_vmstat_delta_counts_events_since_the_start_and_gives_the_gauges_at_both_ends():
    v0 = vmstat()
    assert "nr_free_pages" in v0   # Linux
    d = vmstat_delta(v0)
    assert all(d[k] >= 0 for k in EVENTS)
    assert all(d[k + "_start"] == v0.get(k, 0) and d[k + "_end"] >= 0 for k in GAUGES)


def test_the_read_only_lookups_verdict_is_by_cpu_beside_wall_with_the_tiers_major_faults(capsys):
    def side(cpu, rate, majflt):
        return dict(_side(1.0, 1.0), find1k_cpu_us_per_key=cpu, find1k_keys_per_s=rate, find1k_majflt=majflt)
    _print_rounds([(side(1.0, 200.0, 0), side(2.0, 50.0, 7)), (side(1.0, 100.0, 0), side(1.25, 100.0, 0))])
    out = capsys.readouterr().out
    assert "by CPU 0.50x, 0.80x (median 0.65x); by wall 0.25x, 1.00x (median 0.62x)" in out
    assert "major faults 7, 0" in out
