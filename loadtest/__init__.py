"""Production-shaped workloads, the live load generator, reports and plots."""
