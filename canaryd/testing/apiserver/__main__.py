from canaryd.testing.apiserver.standalone import main

if __name__ == "__main__":
    main()
