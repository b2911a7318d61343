from tray.command import program

program()
