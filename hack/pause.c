/* The pod sandbox ("pause") process of the local test node: it holds the pod's namespaces,
 * reaps the children it inherits and exits 0 on SIGTERM/SIGINT. hack/node-images.sh builds it
 * with `gcc -static -O2` into the image registry.k8s.io/pause:3.6, containerd 1.6's default
 * sandbox image, which the node cannot pull (no container registry is reachable). */
#include <errno.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

static void on_term(int sig) { (void)sig; _exit(0); }

static void on_chld(int sig) {
    int saved = errno;
    (void)sig;
    while (waitpid(-1, NULL, WNOHANG) > 0) {}
    errno = saved;
}

int main(void) {
    struct sigaction sa = {0};
    sigemptyset(&sa.sa_mask);
    sa.sa_handler = on_term;
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    sa.sa_handler = on_chld;
    sa.sa_flags = SA_NOCLDSTOP | SA_RESTART;
    sigaction(SIGCHLD, &sa, NULL);
    for (;;) pause();
}
