// Command etcd is etcd's own server entry point (go.etcd.io/etcd/v3's
// main.go), built in a module of its own so that etcd's dependencies never
// raise the versions the Kubernetes build selects.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
