from tray.cli import program

program()
