"""The fleet: pools, replicas, routing, health, drift, repartitioning, actuators and the emulated replica."""
