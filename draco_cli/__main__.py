from draco_cli.cli import main

main()
