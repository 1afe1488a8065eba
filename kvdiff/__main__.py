from kvdiff.cli import main

main()
