"""Park/wake throughput as a program: its rank program and `tray bench park`."""
