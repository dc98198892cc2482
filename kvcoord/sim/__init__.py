"""The cluster simulator: workloads, simulated nodes running real block pools, reports."""
