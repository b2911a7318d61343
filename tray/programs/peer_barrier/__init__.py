"""The peer barrier as a program: the gate (`tray gate peer-barrier`: launch a tray, time its barrier, or
prove that a dropped rank is named) and its rank program."""
