// Command etcd runs the etcd server from go.etcd.io/etcd/server/v3, built from the
// Go module proxy so the local control plane needs no downloaded release binary.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
