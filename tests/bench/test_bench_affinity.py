"""`make bench-affinity` at toy size: both placements run end to end through the real gateway and
proxies, the table prints, and the gateway's placement beats the random one. Not timed."""

from __future__ import annotations

from epd_dev.bench import bench_affinity


def test_bench_affinity_runs_both_placements_and_the_gateway_primes_less(capsys):
    assert bench_affinity.main(["--units", "3", "--conversations", "24", "--groups", "3", "--concurrency", "8"]) == 0
    printed = capsys.readouterr().out
    assert "gateway (affinity)" in printed and "random (kube-proxy)" in printed
    rows = {
        " ".join(line.split()[:2]): line.split()
        for line in printed.splitlines()
        if line.strip().startswith(("gateway (affinity) ", "random (kube-proxy) "))
    }
    gateway, spread = rows["gateway (affinity)"], rows["random (kube-proxy)"]
    # placement (2 words), requests, pictures, primes, ...: the gateway primes fewer, nobody misses.
    assert int(gateway[4]) < int(spread[4])
    assert gateway[-2] == spread[-2] == "0"  # consumer misses
