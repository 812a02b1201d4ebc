module canaryd.test/node/pause

go 1.22
