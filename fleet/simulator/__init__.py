"""The virtual-time fleet simulator: the real router, controller and engine scheduler on a virtual clock."""
