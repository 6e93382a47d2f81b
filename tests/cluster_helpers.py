"""The tests' local Ray cluster: engine.bench.cluster.LocalCluster (head + N workers on this
machine, memory cgroups where writable), re-exported."""

from engine.bench.cluster import LocalCluster, cgroups_writable  # noqa: F401
