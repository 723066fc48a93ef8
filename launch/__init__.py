"""numa-launch: NUMA topology detection and the mpirun + numactl command line."""
