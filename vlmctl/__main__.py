from vlmctl.cli.app import main

main()
