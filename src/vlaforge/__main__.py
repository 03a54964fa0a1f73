from vlaforge.cli import main

main()
